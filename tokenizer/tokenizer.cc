#include "tokenizer/tokenizer.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "tokenizer/internal/decoding.h"
#include "tokenizer/internal/impl.h"
#include "tokenizer/internal/read_file.h"
#include "tokenizer/internal/unicode.h"

namespace accel::tokenizer {
namespace {

constexpr absl::string_view kReplacementChar = "\xEF\xBF\xBD";

}  // namespace

Tokenizer::Tokenizer(std::shared_ptr<const internal::TokenizerImpl> impl)
    : impl_(std::move(impl)) {}

absl::StatusOr<Tokenizer> Tokenizer::FromFile(const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(
      std::string json,
      internal::ReadWholeFile(path, internal::kMaxTokenizerFileBytes, "tokenizer.json"));
  return FromJson(json, path);
}

absl::StatusOr<Tokenizer> Tokenizer::FromJson(absl::string_view json,
                                              absl::string_view source_name) {
  ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<internal::TokenizerImpl> impl,
                         internal::TokenizerImpl::FromJson(json, source_name));
  return Tokenizer(std::shared_ptr<const internal::TokenizerImpl>(std::move(impl)));
}

absl::StatusOr<std::vector<int64_t>> Tokenizer::Encode(absl::string_view text,
                                                       bool add_special_tokens) const {
  return impl_->Encode(text, add_special_tokens);
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int64_t> ids,
                                              bool skip_special_tokens) const {
  return impl_->Decode(ids, skip_special_tokens);
}

absl::StatusOr<std::string> Tokenizer::TokenBytes(int64_t id) const {
  return impl_->TokenBytes(id);
}

std::optional<int64_t> Tokenizer::TokenToId(absl::string_view token) const {
  return impl_->TokenToId(token);
}

std::optional<std::string> Tokenizer::IdToToken(int64_t id) const {
  const std::string* token = impl_->TokenOf(id);
  if (token == nullptr) return std::nullopt;
  return *token;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size(); }

bool Tokenizer::IsSpecial(int64_t id) const {
  const std::string* token = impl_->TokenOf(id);
  return token != nullptr && impl_->IsSpecialContent(*token);
}

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : impl_(tokenizer.impl_), skip_special_tokens_(skip_special_tokens) {}

absl::StatusOr<std::string> IncrementalDecoder::Next(int64_t id) {
  if (id < 0 || id >= impl_->vocab_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id ", id, " is out of range [0, ", impl_->vocab_size(), ")"));
  }
  ids_.push_back(id);
  const std::string* token = impl_->TokenOf(id);
  if (token != nullptr && !(skip_special_tokens_ && impl_->IsSpecialContent(*token))) {
    last_kept_is_byte_ = internal::ByteFallbackValue(*token).has_value();
  }
  // A run of byte tokens is decoded as one group: its text is final only
  // once a token of another kind follows.
  if (last_kept_is_byte_ && impl_->GroupsByteTokens()) return std::string();
  const absl::Span<const int64_t> all(ids_);
  ACCEL_ASSIGN_OR_RETURN(std::string prefix_text,
                         impl_->Decode(all.subspan(prefix_offset_, read_offset_ - prefix_offset_),
                                       skip_special_tokens_));
  ACCEL_ASSIGN_OR_RETURN(std::string new_text,
                         impl_->Decode(all.subspan(prefix_offset_), skip_special_tokens_));
  // Decoding a window can differ from decoding everything at its start (a
  // stripped leading space, a partial character); both decodes share that
  // start, so what the new ids add is the difference, once it is whole.
  if (new_text.size() > prefix_text.size() && absl::StartsWith(new_text, prefix_text) &&
      !absl::EndsWith(new_text, kReplacementChar)) {
    std::string piece = new_text.substr(prefix_text.size());
    prefix_offset_ = read_offset_;
    read_offset_ = ids_.size();
    emitted_.append(piece);
    return piece;
  }
  return std::string();
}

std::string IncrementalDecoder::Flush() {
  // Every id was checked by Next(), so decoding cannot fail.
  absl::StatusOr<std::string> full = impl_->Decode(ids_, skip_special_tokens_);
  std::string rest;
  if (full.ok()) {
    size_t common = 0;
    if (absl::StartsWith(*full, emitted_)) {
      common = emitted_.size();
    } else {
      // Not reachable with the decoders we have; never split a character.
      while (common < full->size() && common < emitted_.size() &&
             (*full)[common] == emitted_[common]) {
        ++common;
      }
      while (common > 0 && (static_cast<unsigned char>((*full)[common]) & 0xC0) == 0x80) --common;
    }
    rest = full->substr(common);
  }
  ids_.clear();
  emitted_.clear();
  prefix_offset_ = 0;
  read_offset_ = 0;
  last_kept_is_byte_ = false;
  return rest;
}

bool IsValidUtf8(absl::string_view text) { return internal::IsValidUtf8(text); }

}  // namespace accel::tokenizer
