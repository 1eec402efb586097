#include "tokenizer/internal/bpe.h"

#include <mutex>
#include <queue>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

#include "core/status.h"
#include "tokenizer/internal/unicode.h"

namespace accel::tokenizer::internal {
namespace {

// HF caches words shorter than this many bytes.
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kCacheShards = 16;
constexpr size_t kCacheShardCapacity = 1024;

uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

// Word -> ids, bounded: a full shard is emptied (HF stops inserting instead;
// both only change speed, never results).
class BpeModel::Cache {
 public:
  bool Get(absl::string_view word, std::vector<int64_t>* ids) {
    Shard& shard = ShardFor(word);
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.map.find(word);
    if (it == shard.map.end()) return false;
    ids->insert(ids->end(), it->second.begin(), it->second.end());
    return true;
  }
  void Put(absl::string_view word, const std::vector<int32_t>& ids) {
    Shard& shard = ShardFor(word);
    std::lock_guard<std::mutex> lock(shard.mu);
    if (shard.map.size() >= kCacheShardCapacity) shard.map.clear();
    shard.map.emplace(std::string(word), ids);
  }

 private:
  struct Shard {
    std::mutex mu;
    absl::flat_hash_map<std::string, std::vector<int32_t>> map;  // guarded by mu
  };
  Shard& ShardFor(absl::string_view word) {
    return shards_[absl::Hash<absl::string_view>{}(word) % kCacheShards];
  }
  std::array<Shard, kCacheShards> shards_;
};

BpeModel::BpeModel() : cache_(std::make_unique<Cache>()) { byte_ids_.fill(-1); }
BpeModel::~BpeModel() = default;

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::Parse(const JsonReader& reader,
                                                          const Json& value,
                                                          const std::string& path) {
  ACCEL_RETURN_IF_ERROR(reader.ExpectObject(value, path));
  if (JsonReader::Find(value, "type") != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(std::string type, reader.Type(value, path));
    if (type != "BPE") {
      return reader.Unsupported(JsonReader::Child(path, "type"),
                                absl::StrCat("the model type \"", type, "\""));
    }
  } else if (JsonReader::Find(value, "merges") == nullptr) {
    return reader.Invalid(JsonReader::Child(path, "type"), "is missing");
  }
  if (const Json* dropout = JsonReader::Find(value, "dropout");
      dropout != nullptr && !dropout->is_null()) {
    if (!dropout->is_number()) {
      return reader.Invalid(JsonReader::Child(path, "dropout"), "must be a number or null");
    }
    // HF treats 0 as no dropout; any other value samples merges at random.
    if (dropout->get<double>() != 0.0) {
      return reader.Unsupported(JsonReader::Child(path, "dropout"), "BPE dropout");
    }
  }
  std::unique_ptr<BpeModel> model(new BpeModel());
  ACCEL_ASSIGN_OR_RETURN(model->unk_token_, reader.OptionalString(value, path, "unk_token"));
  ACCEL_ASSIGN_OR_RETURN(auto prefix,
                         reader.OptionalString(value, path, "continuing_subword_prefix"));
  ACCEL_ASSIGN_OR_RETURN(auto suffix, reader.OptionalString(value, path, "end_of_word_suffix"));
  model->prefix_ = prefix.value_or("");
  model->suffix_ = suffix.value_or("");
  ACCEL_ASSIGN_OR_RETURN(model->fuse_unk_, reader.Bool(value, path, "fuse_unk", false));
  ACCEL_ASSIGN_OR_RETURN(model->byte_fallback_, reader.Bool(value, path, "byte_fallback", false));
  ACCEL_ASSIGN_OR_RETURN(model->ignore_merges_, reader.Bool(value, path, "ignore_merges", false));

  const std::string vocab_path = JsonReader::Child(path, "vocab");
  const Json* vocab = JsonReader::Find(value, "vocab");
  if (vocab == nullptr) return reader.Invalid(vocab_path, "is missing");
  ACCEL_RETURN_IF_ERROR(reader.ExpectObject(*vocab, vocab_path));
  model->vocab_.reserve(vocab->size());
  int64_t max_id = -1;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    ACCEL_ASSIGN_OR_RETURN(
        int64_t id,
        reader.IntValue(it.value(), absl::StrCat(vocab_path, "[\"", absl::CEscape(it.key()), "\"]"),
                        0, kMaxTokenId));
    model->vocab_[it.key()] = static_cast<int32_t>(id);
    max_id = std::max(max_id, id);
  }
  model->id_to_token_.resize(static_cast<size_t>(max_id + 1));
  model->has_id_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [token, id] : model->vocab_) {
    model->id_to_token_[id] = token;
    model->has_id_[id] = true;
    size_t pos = 0;
    if (!token.empty()) {
      const char32_t c = NextChar(token, &pos);
      if (pos == token.size()) model->char_ids_[c] = id;
    }
  }
  for (int b = 0; b < 256; ++b) {
    auto it = model->vocab_.find(absl::StrFormat("<0x%02X>", b));
    if (it != model->vocab_.end()) model->byte_ids_[b] = it->second;
  }

  const std::string merges_path = JsonReader::Child(path, "merges");
  ACCEL_ASSIGN_OR_RETURN(const Json* merges, reader.Array(value, path, "merges"));
  model->merges_.reserve(merges->size());
  // All "a b" strings (lines starting with #version skipped) or all [a, b] pairs.
  bool strings = false;
  bool pairs = false;
  uint32_t rank = 0;
  for (size_t i = 0; i < merges->size(); ++i) {
    const Json& merge = (*merges)[i];
    const std::string merge_path = JsonReader::Index(merges_path, i);
    std::string a;
    std::string b;
    if (merge.is_string()) {
      strings = true;
      const std::string& line = merge.get_ref<const std::string&>();
      if (absl::StartsWith(line, "#version")) continue;
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      if (parts.size() != 2) {
        return reader.Invalid(merge_path, absl::StrCat("must be two tokens separated by one space, "
                                                       "got \"",
                                                       absl::CEscape(line), "\""));
      }
      a = std::move(parts[0]);
      b = std::move(parts[1]);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      pairs = true;
      a = merge[0].get<std::string>();
      b = merge[1].get<std::string>();
    } else {
      return reader.Invalid(merge_path, "must be a string \"a b\" or a pair [\"a\", \"b\"]");
    }
    if (strings && pairs) {
      return reader.Invalid(merge_path, "mixes \"a b\" strings and [a, b] pairs");
    }
    auto token_id = [&](const std::string& token) -> absl::StatusOr<int32_t> {
      auto it = model->vocab_.find(token);
      if (it == model->vocab_.end()) {
        return reader.Invalid(merge_path, absl::StrCat("names the token \"", absl::CEscape(token),
                                                       "\", which is not in the vocabulary"));
      }
      return it->second;
    };
    ACCEL_ASSIGN_OR_RETURN(int32_t a_id, token_id(a));
    ACCEL_ASSIGN_OR_RETURN(int32_t b_id, token_id(b));
    if (b.size() < model->prefix_.size()) {
      return reader.Invalid(merge_path,
                            "has a second token shorter than continuing_subword_prefix");
    }
    ACCEL_ASSIGN_OR_RETURN(int32_t new_id, token_id(a + b.substr(model->prefix_.size())));
    // A repeated pair keeps its last rank, as HF's map does.
    model->merges_.insert_or_assign(PairKey(a_id, b_id), MergeInfo{rank, new_id});
    ++rank;
  }
  return model;
}

std::optional<int64_t> BpeModel::TokenToId(absl::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int64_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(id_to_token_.size()) || !has_id_[id]) return nullptr;
  return &id_to_token_[id];
}

const BpeModel::MergeInfo* BpeModel::FindMerge(int32_t a, int32_t b) const {
  auto it = merges_.find(PairKey(a, b));
  return it == merges_.end() ? nullptr : &it->second;
}

absl::Status BpeModel::Tokenize(absl::string_view word, std::vector<int64_t>* ids) const {
  if (word.empty()) return absl::OkStatus();
  if (ignore_merges_) {
    // Llama 3: a word the vocabulary has is one token, whatever the merges say.
    auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      ids->push_back(it->second);
      return absl::OkStatus();
    }
  }
  if (cache_->Get(word, ids)) return absl::OkStatus();
  std::vector<int32_t> merged;
  ACCEL_RETURN_IF_ERROR(MergeWord(word, &merged));
  ids->insert(ids->end(), merged.begin(), merged.end());
  if (word.size() < kMaxCachedWordBytes) cache_->Put(word, merged);
  return absl::OkStatus();
}

absl::Status BpeModel::MergeWord(absl::string_view word, std::vector<int32_t>* ids) const {
  std::vector<int32_t> symbols;
  std::vector<uint32_t> lens;
  symbols.reserve(word.size());
  lens.reserve(word.size());
  const bool plain = prefix_.empty() && suffix_.empty();
  // A pending unknown symbol: its id and byte length (fused runs add up).
  int32_t unk_id = -1;
  uint32_t unk_len = 0;
  auto unk_token_id = [&]() -> absl::StatusOr<int32_t> {
    auto it = vocab_.find(*unk_token_);
    if (it == vocab_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unk_token \"", absl::CEscape(*unk_token_), "\" is not in the vocabulary"));
    }
    return it->second;
  };
  std::string piece;
  size_t pos = 0;
  while (pos < word.size()) {
    const size_t start = pos;
    const char32_t c = NextChar(word, &pos);
    const auto byte_len = static_cast<uint32_t>(pos - start);
    int32_t id = -1;
    absl::string_view s = word.substr(start, byte_len);
    if (plain) {
      auto it = char_ids_.find(c);
      if (it != char_ids_.end()) id = it->second;
    } else {
      piece.clear();
      if (start > 0) piece.append(prefix_);
      piece.append(s.data(), s.size());
      if (pos == word.size()) piece.append(suffix_);
      s = piece;
      auto it = vocab_.find(s);
      if (it != vocab_.end()) id = it->second;
    }
    if (id >= 0) {
      if (unk_id >= 0) {
        symbols.push_back(unk_id);
        lens.push_back(unk_len);
        unk_id = -1;
      }
      symbols.push_back(id);
      lens.push_back(byte_len);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char ch : s) all = all && byte_ids_[static_cast<unsigned char>(ch)] >= 0;
      if (all) {
        // As HF: a pending unknown symbol is not flushed before the bytes.
        for (char ch : s) {
          symbols.push_back(byte_ids_[static_cast<unsigned char>(ch)]);
          lens.push_back(1);
        }
        continue;
      }
    }
    if (unk_token_.has_value()) {
      if (unk_id >= 0 && fuse_unk_) {
        unk_len += byte_len;
      } else {
        if (unk_id >= 0) {
          symbols.push_back(unk_id);
          lens.push_back(unk_len);
        }
        ACCEL_ASSIGN_OR_RETURN(unk_id, unk_token_id());
        unk_len = byte_len;
      }
    }
    // Without unk_token an unknown character is dropped, as HF does.
  }
  if (unk_id >= 0) {
    symbols.push_back(unk_id);
    lens.push_back(unk_len);
  }
  MergeAll(&symbols, lens);
  *ids = std::move(symbols);
  return absl::OkStatus();
}

void BpeModel::MergeAll(std::vector<int32_t>* ids, const std::vector<uint32_t>& lens) const {
  const size_t n = ids->size();
  if (n < 2) return;
  struct Symbol {
    int32_t id;
    int64_t prev;
    int64_t next;
    uint32_t len;
  };
  std::vector<Symbol> symbols(n);
  for (size_t i = 0; i < n; ++i) {
    symbols[i] = {(*ids)[i], static_cast<int64_t>(i) - 1,
                  i + 1 < n ? static_cast<int64_t>(i + 1) : -1, lens[i]};
  }
  struct Candidate {
    uint32_t rank;
    size_t pos;
    int32_t new_id;
  };
  // Lowest rank first, then leftmost: HF's Merge ordering.
  auto later = [](const Candidate& x, const Candidate& y) {
    return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
  for (size_t i = 0; i + 1 < n; ++i) {
    if (const MergeInfo* m = FindMerge(symbols[i].id, symbols[i + 1].id)) {
      queue.push({m->rank, i, m->new_id});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& cur = symbols[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const auto next_pos = static_cast<size_t>(cur.next);
    const Symbol right = symbols[next_pos];
    // Skip a stale entry: the pair at this position is no longer the one queued.
    const MergeInfo* now = FindMerge(cur.id, right.id);
    if (now == nullptr || now->new_id != top.new_id) continue;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    symbols[next_pos].len = 0;
    if (right.next >= 0 && static_cast<size_t>(right.next) < n) {
      symbols[static_cast<size_t>(right.next)].prev = static_cast<int64_t>(top.pos);
    }
    if (cur.prev >= 0) {
      const auto prev = static_cast<size_t>(cur.prev);
      if (const MergeInfo* m = FindMerge(symbols[prev].id, cur.id)) {
        queue.push({m->rank, prev, m->new_id});
      }
    }
    if (cur.next >= 0) {
      if (const MergeInfo* m = FindMerge(cur.id, symbols[static_cast<size_t>(cur.next)].id)) {
        queue.push({m->rank, top.pos, m->new_id});
      }
    }
  }
  ids->clear();
  for (const Symbol& s : symbols) {
    if (s.len != 0) ids->push_back(s.id);
  }
}

}  // namespace accel::tokenizer::internal
