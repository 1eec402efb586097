#include "tokenizer/internal/impl.h"

#include <algorithm>
#include <exception>
#include <new>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/json.h"
#include "core/status.h"
#include "tokenizer/internal/unicode.h"

namespace accel::tokenizer::internal {
namespace {

// Byte offset of the first invalid UTF-8 sequence (for the error message).
size_t FirstInvalidUtf8(absl::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t n = Utf8Length(static_cast<unsigned char>(text[pos]));
    if (pos + n > text.size() || !IsValidUtf8(text.substr(pos, n))) return pos;
    pos += n;
  }
  return text.size();
}

absl::StatusOr<std::vector<AddedToken>> ParseAddedTokens(const JsonReader& reader,
                                                         const Json& root) {
  std::vector<AddedToken> tokens;
  const Json* list = JsonReader::Find(root, "added_tokens");
  if (list == nullptr || list->is_null()) return tokens;
  if (!list->is_array()) return reader.Invalid("added_tokens", "must be an array");
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string path = JsonReader::Index("added_tokens", i);
    const Json& item = (*list)[i];
    ACCEL_RETURN_IF_ERROR(reader.ExpectObject(item, path));
    AddedToken t;
    ACCEL_ASSIGN_OR_RETURN(t.id, reader.Int(item, path, "id", 0, kMaxTokenId));
    ACCEL_ASSIGN_OR_RETURN(t.content, reader.String(item, path, "content"));
    ACCEL_ASSIGN_OR_RETURN(t.single_word, reader.Bool(item, path, "single_word", false));
    ACCEL_ASSIGN_OR_RETURN(t.lstrip, reader.Bool(item, path, "lstrip", false));
    ACCEL_ASSIGN_OR_RETURN(t.rstrip, reader.Bool(item, path, "rstrip", false));
    ACCEL_ASSIGN_OR_RETURN(t.special, reader.Bool(item, path, "special", false));
    ACCEL_ASSIGN_OR_RETURN(t.normalized, reader.Bool(item, path, "normalized", !t.special));
    tokens.push_back(std::move(t));
  }
  return tokens;
}

const Json& Member(const Json& root, absl::string_view key) {
  static const Json* const kNull = new Json(nullptr);
  const Json* v = JsonReader::Find(root, key);
  return v == nullptr ? *kNull : *v;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenizerImpl>> TokenizerImpl::FromJson(absl::string_view json,
                                                                       absl::string_view source) {
  const JsonReader reader(source);
  JsonLimits limits;
  limits.max_depth = kMaxJsonDepth;
  absl::StatusOr<Json> parsed = ParseJson(json, source, limits);
  if (!parsed.ok()) return parsed.status();
  // nlohmann throws; nothing it throws leaves this function.
  try {
    const Json root = *std::move(parsed);
    ACCEL_RETURN_IF_ERROR(reader.ExpectObject(root, ""));
    if (const Json* version = JsonReader::Find(root, "version"); version != nullptr) {
      if (!version->is_string() || version->get<std::string>() != "1.0") {
        return reader.Invalid("version", absl::StrCat("must be \"1.0\", got ", version->dump()));
      }
    }
    // Truncation and padding change what encode returns; we do not do either.
    for (absl::string_view key : {"truncation", "padding"}) {
      if (!Member(root, key).is_null())
        return reader.Unsupported(key, absl::StrCat("non-null ", key));
    }
    std::unique_ptr<TokenizerImpl> impl(new TokenizerImpl());
    const Json* model = JsonReader::Find(root, "model");
    if (model == nullptr) return reader.Invalid("model", "is missing");
    ACCEL_ASSIGN_OR_RETURN(impl->model_, BpeModel::Parse(reader, *model, "model"));
    ACCEL_ASSIGN_OR_RETURN(impl->normalizer_,
                           ParseNormalizer(reader, Member(root, "normalizer"), "normalizer"));
    ACCEL_ASSIGN_OR_RETURN(
        impl->pre_tokenizer_,
        ParsePreTokenizer(reader, Member(root, "pre_tokenizer"), "pre_tokenizer"));
    ACCEL_ASSIGN_OR_RETURN(
        impl->post_processor_,
        ParsePostProcessor(reader, Member(root, "post_processor"), "post_processor"));
    ACCEL_ASSIGN_OR_RETURN(impl->decoder_,
                           ParseDecoder(reader, Member(root, "decoder"), "decoder"));
    ACCEL_ASSIGN_OR_RETURN(std::vector<AddedToken> added, ParseAddedTokens(reader, root));

    // HF adds the tokens one by one and does not take their ids from the file:
    // a content already added or in the model's vocabulary keeps that id, any
    // other gets the next id past the model's vocabulary (HF only warns when
    // that differs from the file). A token equal in every field to one
    // already added is ignored.
    std::vector<AddedToken> kept;
    absl::flat_hash_set<std::string> seen;  // content and flags of every token kept
    const int64_t model_size = impl->model_->num_tokens();
    int64_t max_added = -1;
    for (AddedToken& t : added) {
      if (t.content.empty()) continue;
      const char flags[] = {static_cast<char>('0' + t.single_word),
                            static_cast<char>('0' + t.lstrip), static_cast<char>('0' + t.rstrip),
                            static_cast<char>('0' + t.normalized),
                            static_cast<char>('0' + t.special)};
      if (!seen.insert(absl::StrCat(absl::string_view(flags, sizeof(flags)), t.content)).second) {
        continue;
      }
      if (auto it = impl->added_by_content_.find(t.content); it != impl->added_by_content_.end()) {
        t.id = it->second;
      } else if (std::optional<int64_t> id = impl->model_->TokenToId(t.content)) {
        t.id = *id;
      } else if (max_added < 0) {
        t.id = model_size;
      } else {
        t.id = (max_added >= model_size || model_size == 0) ? max_added + 1 : model_size;
      }
      if (t.id > kMaxTokenId) return reader.Invalid("added_tokens", "assign ids past the limit");
      max_added = std::max(max_added, t.id);
      impl->added_by_content_[t.content] = t.id;
      impl->added_by_id_[t.id] = t.content;
      if (t.special) impl->special_contents_.insert(t.content);
      kept.push_back(t);
    }
    added = std::move(kept);
    std::vector<AddedToken> specials;
    std::vector<AddedToken> others;
    absl::flat_hash_set<std::string> specials_so_far;
    for (AddedToken& t : added) {
      if (t.special && specials_so_far.insert(t.content).second) {
        specials.push_back(t);
      } else if (!specials_so_far.contains(t.content)) {
        others.push_back(std::move(t));
      }
    }
    std::vector<AddedToken> ordered = std::move(specials);
    for (AddedToken& t : others) ordered.push_back(std::move(t));
    impl->added_ = std::make_unique<AddedVocabulary>(std::move(ordered), impl->normalizer_.get());

    int64_t max_id = impl->model_->max_id();
    for (const auto& [id, content] : impl->added_by_id_) max_id = std::max(max_id, id);
    impl->vocab_size_ = max_id + 1;
    return impl;
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", e.what()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(source, ": out of memory while loading"));
  }
}

absl::StatusOr<std::vector<int64_t>> TokenizerImpl::Encode(absl::string_view text,
                                                           bool add_special_tokens) const {
  if (!IsValidUtf8(text)) {
    return absl::InvalidArgumentError(
        absl::StrCat("text to encode is not valid UTF-8 (at byte ", FirstInvalidUtf8(text), ")"));
  }
  std::vector<Piece> pieces;
  if (!text.empty()) {
    Piece whole;
    whole.text = std::string(text);
    whole.at_origin = true;
    whole.zero_len = Utf8Length(static_cast<unsigned char>(text[0]));
    pieces.push_back(std::move(whole));
  }
  added_->Split(&pieces, /*normalized=*/false);
  if (normalizer_ != nullptr) {
    for (Piece& piece : pieces) {
      if (piece.token < 0) normalizer_->Normalize(&piece.text, &piece.zero_len);
    }
  }
  added_->Split(&pieces, /*normalized=*/true);
  if (pre_tokenizer_ != nullptr) pre_tokenizer_->PreTokenize(&pieces);
  std::vector<int64_t> ids;
  ids.reserve(text.size() / 3 + 4);
  for (const Piece& piece : pieces) {
    if (piece.token >= 0) {
      ids.push_back(piece.token);
    } else {
      ACCEL_RETURN_IF_ERROR(model_->Tokenize(piece.text, &ids));
    }
  }
  if (add_special_tokens && post_processor_ != nullptr) post_processor_->Process(&ids);
  return ids;
}

const std::string* TokenizerImpl::TokenOf(int64_t id) const {
  if (auto it = added_by_id_.find(id); it != added_by_id_.end()) return &it->second;
  return model_->IdToToken(id);
}

std::optional<int64_t> TokenizerImpl::TokenToId(absl::string_view token) const {
  if (auto it = added_by_content_.find(token); it != added_by_content_.end()) return it->second;
  return model_->TokenToId(token);
}

absl::StatusOr<std::string> TokenizerImpl::Decode(absl::Span<const int64_t> ids,
                                                  bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is out of range [0, ", vocab_size_, ")"));
    }
    const std::string* token = TokenOf(id);
    if (token == nullptr) continue;  // a hole in the vocabulary: HF skips it
    if (skip_special_tokens && special_contents_.contains(*token)) continue;
    tokens.push_back(*token);
  }
  if (decoder_ == nullptr) return absl::StrJoin(tokens, " ");
  decoder_->DecodeChain(&tokens);
  return absl::StrJoin(tokens, "");
}

absl::StatusOr<std::string> TokenizerImpl::TokenBytes(int64_t id) const {
  if (id < 0 || id >= vocab_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id ", id, " is out of range [0, ", vocab_size_, ")"));
  }
  const std::string* token = TokenOf(id);
  if (token == nullptr) return std::string();
  if (decoder_ == nullptr) return *token;
  // What the token adds after another: decode it alone and twice, and keep
  // the second copy (a first token loses a leading space to Metaspace's
  // prepend scheme or a Strip decoder; one in the middle keeps it).
  std::vector<std::string> once = {*token};
  std::vector<std::string> twice = {*token, *token};
  decoder_->DecodeChainBytes(&once);
  decoder_->DecodeChainBytes(&twice);
  const std::string first = absl::StrJoin(once, "");
  const std::string both = absl::StrJoin(twice, "");
  if (both.size() >= first.size() && both.compare(0, first.size(), first) == 0) {
    return both.substr(first.size());
  }
  return first;
}

}  // namespace accel::tokenizer::internal
