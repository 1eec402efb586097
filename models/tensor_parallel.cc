#include "models/tensor_parallel.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#include "core/status.h"
#include "core/thread_name.h"
#include "dist/process_group.h"
#include "models/families.h"
#include "models/internal/decoder_lm.h"

namespace accel::models {
namespace {

absl::Status NotDivisible(absl::string_view field, int64_t value, int size, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor_parallel_size ", size, ": config.json's ", field, " (", value,
      ") is not divisible by it", why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
}

}  // namespace

absl::Status CheckTensorParallel(const loader::ModelConfig& c, int size) {
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_parallel_size ", size, ": must be at least 1"));
  }
  if (size == 1) return absl::OkStatus();
  ACCEL_ASSIGN_OR_RETURN(ResolvedConfig r, ResolveConfig(c));
  if (c.num_attention_heads % size != 0) {
    return NotDivisible("num_attention_heads", c.num_attention_heads, size,
                        "each rank holds whole query heads");
  }
  const int64_t kv = c.kv_heads();
  if (kv % size != 0 && !(kv < size && size % kv == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel_size ", size, ": config.json's num_key_value_heads (", kv,
        ") is neither divisible by it nor a divisor of it (fewer key/value heads than ranks are "
        "replicated, N / KV ranks each)"));
  }
  bool dense = false;
  for (bool sparse : r.sparse) dense |= !sparse;
  if (dense && c.intermediate_size % size != 0) {
    return NotDivisible("intermediate_size", c.intermediate_size, size, "");
  }
  if (r.num_experts > 0) {
    const char* field = r.family.moe == MoeKind::kMixtral ? "num_local_experts" : "num_experts";
    if (r.num_experts % size != 0) {
      return NotDivisible(field, r.num_experts, size, "each rank holds whole experts");
    }
    if (r.family.moe == MoeKind::kQwenShared && r.shared_intermediate % size != 0) {
      return NotDivisible("shared_expert_intermediate_size", r.shared_intermediate, size, "");
    }
  }
  return absl::OkStatus();
}

std::pair<int64_t, int64_t> PipelineLayers(int64_t layers, int stage, int stages) {
  std::vector<int64_t> per(static_cast<size_t>(stages), layers / stages);
  const int64_t remainder = layers % stages;
  for (int64_t i = 2; i < remainder + 2; ++i) per[static_cast<size_t>(stages - i)] += 1;
  int64_t first = 0;
  for (int s = 0; s < stage; ++s) first += per[static_cast<size_t>(s)];
  return {first, first + per[static_cast<size_t>(stage)]};
}

std::vector<std::pair<size_t, size_t>> PipelineMicroBatches(absl::Span<const int64_t> chunk_tokens,
                                                            int requested) {
  std::vector<std::pair<size_t, size_t>> out;
  const size_t n = chunk_tokens.size();
  if (n == 0) return out;
  const size_t count = std::min(n, static_cast<size_t>(std::max(requested, 1)));
  int64_t total = 0;
  for (int64_t t : chunk_tokens) total += std::max<int64_t>(t, 0);
  int64_t so_far = 0;
  size_t first = 0;
  for (size_t i = 0; i < n; ++i) {
    so_far += std::max<int64_t>(chunk_tokens[i], 0);
    const size_t later_batches = count - out.size() - 1;  // to open after this one
    const size_t later_chunks = n - i - 1;
    const bool must_cut = later_chunks == later_batches;
    const bool share_reached =
        later_batches > 0 &&
        so_far * static_cast<int64_t>(count) >= total * static_cast<int64_t>(out.size() + 1);
    if (must_cut || share_reached) {
      out.emplace_back(first, i + 1);
      first = i + 1;
    }
  }
  return out;
}

int PipelineAutoMicroBatches(int64_t step_tokens, int stages) {
  const int64_t fit = step_tokens / kMinPipelineMicroBatchTokens;
  return static_cast<int>(std::clamp<int64_t>(fit, 1, std::max(stages, 1)));
}

absl::Status CheckPipelineParallel(const loader::ModelConfig& c, int stages) {
  if (stages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline_parallel_size ", stages, ": must be at least 1"));
  }
  if (stages == 1) return absl::OkStatus();
  ACCEL_RETURN_IF_ERROR(ResolveConfig(c).status());
  if (stages > c.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_parallel_size ", stages, ": more stages than config.json's num_hidden_layers (",
        c.num_hidden_layers, "); each stage runs at least one layer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorParallel> JoinParallelGroups(
    dist::ProcessGroup& world, int size, std::unique_ptr<dist::ProcessGroup>* stage_group) {
  if (size < 1 || world.size() % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor_parallel_size ", size,
                                                   " does not divide the group's ", world.size(),
                                                   " ranks into pipeline stages"));
  }
  TensorParallel tp;
  tp.size = size;
  tp.rank = world.rank() % size;
  tp.pipeline_size = world.size() / size;
  tp.pipeline_rank = world.rank() / size;
  if (tp.pipeline_size == 1) {
    tp.group = &world;
    return tp;
  }
  tp.world = &world;
  if (size > 1) {
    for (int s = 0; s < tp.pipeline_size; ++s) {
      std::vector<int> ranks;
      for (int r = 0; r < size; ++r) ranks.push_back(s * size + r);
      ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<dist::ProcessGroup> group, world.NewGroup(ranks));
      if (group) *stage_group = std::move(group);
    }
    tp.group = stage_group->get();
  }
  return tp;
}

absl::StatusOr<ShardShape> ShardShapeFor(const loader::ModelConfig& c, int rank, int size) {
  ACCEL_RETURN_IF_ERROR(CheckTensorParallel(c, size));
  ACCEL_ASSIGN_OR_RETURN(ResolvedConfig r, ResolveConfig(c));
  ShardShape s;
  s.heads = c.num_attention_heads / size;
  s.first_head = rank * s.heads;
  const int64_t kv = c.kv_heads();
  if (kv % size == 0) {
    s.kv_heads = kv / size;
    s.first_kv_head = rank * s.kv_heads;
  } else {
    // Fewer key/value heads than ranks: the one this rank's query heads share.
    s.kv_heads = 1;
    s.first_kv_head = s.first_head / (c.num_attention_heads / kv);
  }
  s.intermediate = c.intermediate_size / size;
  s.shared_intermediate = r.shared_intermediate / size;
  s.experts = r.num_experts / size;
  s.first_expert = rank * s.experts;
  s.vocab_stride = (c.vocab_size + size - 1) / size;
  s.first_vocab = std::min<int64_t>(c.vocab_size, rank * s.vocab_stride);
  s.vocab = std::min<int64_t>(c.vocab_size, s.first_vocab + s.vocab_stride) - s.first_vocab;
  return s;
}

namespace {

// Which part of a checkpoint tensor a rank holds.
struct Slice {
  enum class Kind { kWhole, kRows, kColumns, kRank0, kSkip, kRename } kind = Kind::kWhole;
  // Rows or columns: [start, start + length) ranges, concatenated.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t full = 0;    // the checkpoint's size along that dimension
  std::string rename;  // the model's name, when it differs
};

class ShardingHook : public dispatch::LoadHook {
 public:
  ShardingHook(ResolvedConfig r, ShardShape s, const TensorParallel& tp, at::ScalarType dtype,
               dispatch::LoadHook* inner)
      : r_(std::move(r)), s_(s), rank_(tp.rank), split_(tp.size > 1), dtype_(dtype), inner_(inner) {
    std::tie(first_layer_, last_layer_) =
        PipelineLayers(r_.config.num_hidden_layers, tp.pipeline_rank, tp.pipeline_size);
    first_stage_ = tp.pipeline_rank == 0;
    last_stage_ = tp.pipeline_rank == tp.pipeline_size - 1;
  }

  bool Claims(absl::string_view name) const override {
    std::optional<Slice> slice = SliceOf(name);
    if (slice && slice->kind != Slice::Kind::kWhole) return true;
    // A split rank copies what it replicates (below).
    return split_ || (inner_ != nullptr && inner_->Claims(name));
  }

  absl::StatusOr<std::vector<dispatch::HookTensor>> Convert(const std::string& name,
                                                            const at::Tensor& stored) override {
    std::optional<Slice> slice = SliceOf(name);
    if (!slice || slice->kind == Slice::Kind::kWhole) {
      if (inner_ != nullptr && inner_->Claims(name)) return inner_->Convert(name, stored);
      at::Tensor converted;
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        converted = c10::isFloatingType(stored.scalar_type()) ? stored.to(dtype_) : stored;
        // Replicated on a split rank (norms, routers: small): a copy, so
        // that nothing reads the file's whole mapping after loading. A read
        // there maps the page cache's whole folio around the page (1 MiB on
        // Linux 6.18 / ext4): the other ranks' slices beside a norm.
        if (split_ && converted.is_same(stored)) converted = stored.clone();
      }));
      return std::vector<dispatch::HookTensor>{{name, converted}};
    }
    if (slice->kind == Slice::Kind::kSkip) return std::vector<dispatch::HookTensor>{};
    const std::string model_name = slice->rename.empty() ? name : slice->rename;
    at::Tensor mine;
    if (slice->kind == Slice::Kind::kRank0) {
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        mine = rank_ == 0 ? stored.to(dtype_).contiguous() : at::zeros(stored.sizes(), dtype_);
      }));
    } else if (slice->kind == Slice::Kind::kRows || slice->kind == Slice::Kind::kColumns) {
      const int64_t dim = slice->kind == Slice::Kind::kRows ? 0 : 1;
      if (stored.dim() <= dim || stored.size(dim) != slice->full) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", name, "': shape [", absl::StrJoin(stored.sizes(), ", "),
                         "] has no ", dim == 0 ? "dimension 0" : "dimension 1", " of ", slice->full,
                         ", which config.json calls for (tensor parallel slicing)"));
      }
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        std::vector<at::Tensor> parts;
        for (const auto& [start, length] : slice->ranges) {
          parts.push_back(stored.narrow(dim, start, length));
        }
        // Only these bytes of the mapping are read.
        mine = (parts.size() == 1 ? parts[0] : at::cat(parts, dim)).to(dtype_).contiguous();
      }));
    } else {
      mine = stored;  // this rank's expert, whole, under its local index
    }
    if (inner_ != nullptr && inner_->Claims(model_name)) return inner_->Convert(model_name, mine);
    at::Tensor converted;
    ACCEL_RETURN_IF_ERROR(CallTorch(
        [&] { converted = c10::isFloatingType(mine.scalar_type()) ? mine.to(dtype_) : mine; }));
    return std::vector<dispatch::HookTensor>{{model_name, converted}};
  }

  absl::Status Finish() override { return inner_ != nullptr ? inner_->Finish() : absl::OkStatus(); }

 private:
  std::optional<Slice> SliceOf(absl::string_view name) const {
    std::optional<Slice> skip = OtherStage(name);
    if (skip) return skip;
    if (!split_) return std::nullopt;
    const int64_t d = r_.config.head_size(), hidden_heads = r_.config.num_attention_heads;
    const int64_t q_out = hidden_heads * d, kv_out = r_.config.kv_heads() * d;
    const std::pair<int64_t, int64_t> q = {s_.first_head * d, s_.heads * d};
    const std::pair<int64_t, int64_t> kv = {s_.first_kv_head * d, s_.kv_heads * d};
    const auto rows = [](std::vector<std::pair<int64_t, int64_t>> ranges, int64_t full) {
      Slice s;
      s.kind = Slice::Kind::kRows;
      s.ranges = std::move(ranges);
      s.full = full;
      return s;
    };
    const auto columns = [](std::pair<int64_t, int64_t> range, int64_t full) {
      Slice s;
      s.kind = Slice::Kind::kColumns;
      s.ranges = {range};
      s.full = full;
      return s;
    };
    if (r_.family.mlp == MlpKind::kGpt2) return Gpt2SliceOf(name);
    if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
      return rows({{s_.first_vocab, s_.vocab}}, r_.config.vocab_size);
    }
    std::vector<std::string> parts = absl::StrSplit(name, '.');
    int64_t layer = -1;
    if (parts.size() < 5 || parts[0] != "model" || parts[1] != "layers" ||
        !absl::SimpleAtoi(parts[2], &layer)) {
      return std::nullopt;
    }
    const std::vector<std::string> rest(parts.begin() + 3, parts.end());
    const std::string& what = rest.back();  // weight / bias
    if (rest[0] == "self_attn" && rest.size() == 3) {
      const std::string& proj = rest[1];
      if (proj == "q_proj") return rows({q}, q_out);
      if (proj == "k_proj" || proj == "v_proj") return rows({kv}, kv_out);
      if (proj == "o_proj" && what == "weight") return columns(q, q_out);
      if (proj == "o_proj" && what == "bias") {
        Slice s;
        s.kind = Slice::Kind::kRank0;
        return s;
      }
      if (proj == "qkv_proj") {
        return rows({q, {q_out + kv.first, kv.second}, {q_out + kv_out + kv.first, kv.second}},
                    q_out + 2 * kv_out);
      }
      return std::nullopt;
    }
    if ((rest[0] == "mlp" || rest[0] == "block_sparse_moe") && rest.size() >= 3) {
      if (rest[1] == "experts" && rest.size() >= 4) {
        int64_t e = -1;
        if (!absl::SimpleAtoi(rest[2], &e)) return std::nullopt;
        Slice s;
        if (e < s_.first_expert || e >= s_.first_expert + s_.experts) {
          s.kind = Slice::Kind::kSkip;
          return s;
        }
        s.kind = Slice::Kind::kRename;
        std::vector<std::string> renamed = parts;
        renamed[5] = absl::StrCat(e - s_.first_expert);
        s.rename = absl::StrJoin(renamed, ".");
        return s;
      }
      // The dense MLP (mlp.gate_proj ...) or Qwen2-MoE's shared expert.
      const bool shared = rest[1] == "shared_expert";
      if (rest.size() != (shared ? 4u : 3u) || rest[0] != "mlp") return std::nullopt;
      const std::string& proj = rest[shared ? 2 : 1];
      const int64_t full = shared ? r_.shared_intermediate : r_.config.intermediate_size;
      const int64_t width = shared ? s_.shared_intermediate : s_.intermediate;
      const std::pair<int64_t, int64_t> mine = {rank_ * width, width};
      if (proj == "gate_proj" || proj == "up_proj") return rows({mine}, full);
      if (proj == "down_proj") return columns(mine, full);
      if (proj == "gate_up_proj") return rows({mine, {full + mine.first, width}}, 2 * full);
    }
    return std::nullopt;
  }

  // GPT-2's Conv1D layers store W [in, out]: a column-parallel layer takes
  // columns of the weight (and the same entries of its bias), a
  // row-parallel one rows. c_attn's output is [q | k | v], hidden each: this
  // rank's heads' columns of each third.
  std::optional<Slice> Gpt2SliceOf(absl::string_view full_name) const {
    absl::string_view name = full_name;
    absl::ConsumePrefix(&name, "transformer.");
    const int64_t hidden = r_.config.hidden_size, d = r_.config.head_size();
    const int64_t inter = r_.config.intermediate_size;
    Slice s;
    if (name == "wte.weight" || name == "lm_head.weight") {
      s.kind = Slice::Kind::kRows;
      s.ranges = {{s_.first_vocab, s_.vocab}};
      s.full = r_.config.vocab_size;
      return s;
    }
    const std::vector<std::string> parts = absl::StrSplit(name, '.');
    int64_t layer = -1;
    if (parts.size() != 5 || parts[0] != "h" || !absl::SimpleAtoi(parts[1], &layer)) {
      return std::nullopt;
    }
    const std::string &block = parts[2], &proj = parts[3], &what = parts[4];
    const bool weight = what == "weight";
    if (!weight && what != "bias") return std::nullopt;
    const std::pair<int64_t, int64_t> heads = {s_.first_head * d, s_.heads * d};
    const std::pair<int64_t, int64_t> width = {rank_ * s_.intermediate, s_.intermediate};
    // A column-parallel layer's weight: columns (dim 1); its bias: the same
    // entries (dim 0).
    const auto column_parallel = [&](std::vector<std::pair<int64_t, int64_t>> ranges,
                                     int64_t full) {
      s.kind = weight ? Slice::Kind::kColumns : Slice::Kind::kRows;
      s.ranges = std::move(ranges);
      s.full = full;
      return s;
    };
    // A row-parallel layer's weight: rows; its bias: rank 0's alone.
    const auto row_parallel = [&](std::pair<int64_t, int64_t> range, int64_t full) {
      s.kind = weight ? Slice::Kind::kRows : Slice::Kind::kRank0;
      s.ranges = {range};
      s.full = full;
      return s;
    };
    if (block == "attn" && proj == "c_attn") {
      return column_parallel(
          {heads, {hidden + heads.first, heads.second}, {2 * hidden + heads.first, heads.second}},
          3 * hidden);
    }
    if (block == "attn" && proj == "c_proj") return row_parallel(heads, hidden);
    if (block == "mlp" && proj == "c_fc") return column_parallel({width}, inter);
    if (block == "mlp" && proj == "c_proj") return row_parallel(width, inter);
    return std::nullopt;
  }

  // kSkip for a tensor another pipeline stage holds: other stages' layers,
  // the embedding past the first stage (kept on the last one of a model
  // whose lm_head shares it), the final norm and lm_head before the last.
  std::optional<Slice> OtherStage(absl::string_view name) const {
    Slice skip;
    skip.kind = Slice::Kind::kSkip;
    const bool tied = r_.config.tie_word_embeddings;
    if (r_.family.mlp == MlpKind::kGpt2) {
      // transformer.wte / wpe / h.<i> / ln_f (the prefix is optional in
      // GPT-2 checkpoints), lm_head.
      absl::string_view local = name;
      absl::ConsumePrefix(&local, "transformer.");
      bool mine = true;
      int64_t layer = -1;
      const std::vector<std::string> parts = absl::StrSplit(local, '.');
      if (local == "wte.weight") {
        mine = first_stage_ || (last_stage_ && tied);
      } else if (absl::StartsWith(local, "wpe.")) {
        mine = first_stage_;
      } else if (local == "lm_head.weight" || absl::StartsWith(local, "ln_f.")) {
        mine = last_stage_;
      } else if (parts.size() >= 2 && parts[0] == "h" && absl::SimpleAtoi(parts[1], &layer)) {
        mine = layer >= first_layer_ && layer < last_layer_;
      }
      if (mine) return std::nullopt;
      return skip;
    }
    if (name == "model.embed_tokens.weight") {
      if (first_stage_ || (last_stage_ && tied)) return std::nullopt;
      return skip;
    }
    if (name == "lm_head.weight" || absl::StartsWith(name, "model.norm.")) {
      if (last_stage_) return std::nullopt;
      return skip;
    }
    const std::vector<std::string> parts = absl::StrSplit(name, '.');
    int64_t layer = -1;
    if (parts.size() >= 3 && parts[0] == "model" && parts[1] == "layers" &&
        absl::SimpleAtoi(parts[2], &layer) && (layer < first_layer_ || layer >= last_layer_)) {
      return skip;
    }
    return std::nullopt;
  }

  ResolvedConfig r_;
  ShardShape s_;
  int rank_;
  bool split_;
  int64_t first_layer_ = 0, last_layer_ = 0;
  bool first_stage_ = true, last_stage_ = true;
  at::ScalarType dtype_;
  dispatch::LoadHook* inner_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<dispatch::LoadHook>> MakeShardingHook(
    const loader::ModelConfig& config, const TensorParallel& tp, at::ScalarType dtype,
    dispatch::LoadHook* inner) {
  ACCEL_ASSIGN_OR_RETURN(ResolvedConfig r, ResolveConfig(config));
  ACCEL_ASSIGN_OR_RETURN(ShardShape s, ShardShapeFor(config, tp.rank, tp.size));
  return std::make_unique<ShardingHook>(std::move(r), s, tp, dtype, inner);
}

// ---------------------------------------------------------------------------
// The step protocol: rank 0 broadcasts one message per step (or a heartbeat,
// or stop); every rank then runs the step's forward, whose collectives pair
// up in the same order on every rank.

namespace {

enum class MessageKind : uint8_t { kStep = 0, kHeartbeat = 1, kStop = 2 };

class Writer {
 public:
  template <typename T>
  void Put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  template <typename T>
  void PutArray(const T* data, int64_t n) {
    Put<int64_t>(n);
    out_.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n) * sizeof(T));
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  template <typename T>
  bool Get(T& value) {
    if (in_.size() - at_ < sizeof(T)) return false;
    std::memcpy(&value, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  template <typename T>
  bool GetArray(std::vector<T>& values) {
    int64_t n = 0;
    if (!Get(n) || n < 0 || static_cast<uint64_t>(n) > (in_.size() - at_) / sizeof(T)) {
      return false;
    }
    values.resize(static_cast<size_t>(n));
    std::memcpy(values.data(), in_.data() + at_, static_cast<size_t>(n) * sizeof(T));
    at_ += static_cast<size_t>(n) * sizeof(T);
    return true;
  }
  bool done() const { return at_ == in_.size(); }

 private:
  const std::string& in_;
  size_t at_ = 0;
};

// Errors a step finds before any collective, the same on every rank (the
// ids and chunks are the same): the ranks stay in step after them.
bool BeforeCollectives(const absl::Status& status) {
  return absl::IsInvalidArgument(status) || absl::IsFailedPrecondition(status) ||
         absl::IsOutOfRange(status);
}

std::mutex fault_mu;
std::optional<std::string>& FaultRecord() {
  static auto* fault = new std::optional<std::string>();
  return *fault;
}

// Records the group's first failure for TensorParallelFault().
absl::Status RecordFault(absl::Status status) {
  std::lock_guard<std::mutex> lock(fault_mu);
  if (!FaultRecord()) FaultRecord() = std::string(status.message());
  return status;
}

int64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}

}  // namespace

std::optional<std::string> TensorParallelFault() {
  std::lock_guard<std::mutex> lock(fault_mu);
  return FaultRecord();
}

TensorParallelLeader::TensorParallelLeader(std::shared_ptr<CausalLM> shard,
                                           dispatch::DispatchedModel* dispatched,
                                           dist::ProcessGroup* group, absl::Duration heartbeat)
    : CausalLM(shard->name(), shard->config(), shard->dtype()),
      shard_(std::move(shard)),
      dispatched_(dispatched),
      group_(group),
      point_to_point_(shard_->pipeline_size() > 1),
      last_message_(std::chrono::steady_clock::now()) {
  // Its parameters count as this model's (the rank's slice); its own
  // Forward runs it under its own names.
  register_module("shard", shard_);
  if (heartbeat > absl::ZeroDuration()) {
    heartbeat_ = std::thread([this, heartbeat] {
      NameThisThread("accel-heartbeat");
      HeartbeatLoop(heartbeat);
    });
  }
}

TensorParallelLeader::~TensorParallelLeader() {
  (void)Stop();
  if (heartbeat_.joinable()) heartbeat_.join();
}

void TensorParallelLeader::HeartbeatLoop(absl::Duration interval) {
  const auto every = absl::ToChronoNanoseconds(interval);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopped_ && !broken_) {
    const auto due = last_message_ + every;
    if (wake_.wait_until(lock, due) == std::cv_status::timeout &&
        std::chrono::steady_clock::now() >= last_message_ + every && !stopped_ && !broken_) {
      Writer w;
      w.Put(MessageKind::kHeartbeat);
      (void)Send(w.Take());
    }
  }
}

bool TensorParallelLeader::healthy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !broken_;
}

absl::Status TensorParallelLeader::Send(const std::string& message) {
  const auto start = std::chrono::steady_clock::now();
  c10::InferenceMode normal(false);  // gloo writes its buffers on its own threads
  absl::Status sent;
  if (point_to_point_) {
    // Pipeline parallel: to each rank in turn, not waited for, so that the
    // leader submits step k + 1 while a later stage still runs step k (a
    // broadcast would wait for it). A rank reads its messages in the order
    // they were posted, after each step's activations, so a heartbeat never
    // overtakes a step. Sends of old messages are waited for here (they
    // were read long ago), keeping the few in flight.
    at::Tensor size, bytes;
    sent = CallTorch([&] {
      bytes = at::empty({static_cast<int64_t>(message.size())}, at::kByte);
      std::memcpy(bytes.data_ptr(), message.data(), message.size());
      size = at::full({1}, static_cast<int64_t>(message.size()), at::kLong);
    });
    for (int rank = 1; rank < group_->size() && sent.ok(); ++rank) {
      for (const at::Tensor& part : {size, bytes}) {
        absl::StatusOr<std::unique_ptr<dist::PendingWork>> work = group_->SendAsync(part, rank);
        if (!work.ok()) {
          sent = work.status();
          break;
        }
        message_sends_.push_back(*std::move(work));
      }
    }
    constexpr size_t kMessageSendsKept = 64;
    while (sent.ok() && message_sends_.size() > kMessageSendsKept) {
      sent = message_sends_.front()->Wait();
      message_sends_.pop_front();
    }
  } else {
    sent = group_->BroadcastBytes(message, 0).status();
  }
  internal::AddCollectiveNanos(NanosSince(start));
  last_message_ = std::chrono::steady_clock::now();
  if (!sent.ok()) {
    broken_ = true;
    wake_.notify_all();
    return RecordFault(absl::UnavailableError(
        absl::StrCat("tensor parallel: sending the step to the worker ranks failed (a worker "
                     "died or stopped answering): ",
                     sent.message())));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> TensorParallelLeader::StepMessage(
    const at::Tensor& input_ids, absl::Span<const SequenceChunk> chunks, Logits which,
    int64_t recompute_after) {
  Writer w;
  w.Put(MessageKind::kStep);
  w.Put(static_cast<uint8_t>(which));
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    const at::Tensor ids = input_ids.to(at::kCPU, at::kLong).contiguous();
    w.PutArray(ids.data_ptr<int64_t>(), ids.numel());
  }));
  int64_t total = 0;
  w.Put<int64_t>(static_cast<int64_t>(chunks.size()));
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SequenceChunk& c = chunks[i];
    if (c.cache != nullptr && !c.cache->paged()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", i,
                       ": tensor parallel steps need paged KV caches (the worker ranks keep "
                       "their heads in their own block stores)"));
    }
    total += c.tokens;
    w.Put<int64_t>(c.tokens);
    // The rows it asks logits for (speculative decoding verifies 1 + k):
    // the last stage and a vocab-parallel head pick the same rows as the leader.
    w.Put<int64_t>(c.logit_tokens);
    w.Put<uint8_t>(c.cache != nullptr ? 1 : 0);
    if (c.cache != nullptr) {
      w.Put<int64_t>(c.cache->length);
      w.Put<int64_t>(c.cache->store->num_blocks());
      w.Put<int64_t>(c.cache->store->block_size());
      w.PutArray(c.cache->block_table.data(), static_cast<int64_t>(c.cache->block_table.size()));
      // A LongRoPE sequence crossing its original context is recomputed
      // from its ids on every rank: they go with this step only (the
      // workers keep nothing of a sequence between steps).
      const bool crossing = recompute_after > 0 && c.cache->length > 0 &&
                            c.cache->length <= recompute_after &&
                            c.cache->length + c.tokens > recompute_after;
      w.Put<uint8_t>(crossing ? 1 : 0);
      if (crossing) {
        w.PutArray(c.cache->token_ids.data(), static_cast<int64_t>(c.cache->token_ids.size()));
      }
    }
  }
  if (total != input_ids.numel()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the chunks hold ", total, " tokens but input_ids has ", input_ids.numel()));
  }
  return w.Take();
}

absl::Status TensorParallelLeader::Failed(const absl::Status& status) {
  if (status.ok() || BeforeCollectives(status)) return status;
  std::lock_guard<std::mutex> lock(mu_);
  broken_ = true;
  wake_.notify_all();
  return RecordFault(
      absl::UnavailableError(absl::StrCat("tensor parallel step failed: ", status.message())));
}

absl::Status TensorParallelLeader::SendStep(const at::Tensor& input_ids,
                                            absl::Span<const SequenceChunk> chunks, Logits which) {
  if (broken_ || stopped_) {
    return absl::UnavailableError(
        "tensor parallel: the worker ranks are gone (an earlier collective failed)");
  }
  ACCEL_ASSIGN_OR_RETURN(std::string message,
                         StepMessage(input_ids, chunks, which, shard_->recompute_after()));
  return Send(message);
}

absl::StatusOr<at::Tensor> TensorParallelLeader::Forward(const at::Tensor& input_ids,
                                                         absl::Span<const SequenceChunk> chunks,
                                                         Logits which,
                                                         dispatch::DispatchedModel* dispatched) {
  absl::StatusOr<at::Tensor> logits;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ACCEL_RETURN_IF_ERROR(SendStep(input_ids, chunks, which));
    logits =
        shard_->Forward(input_ids, chunks, which, dispatched != nullptr ? dispatched : dispatched_);
  }
  if (!logits.ok()) return Failed(logits.status());
  return logits;
}

absl::StatusOr<std::unique_ptr<PendingLogits>> TensorParallelLeader::Submit(
    const at::Tensor& input_ids, absl::Span<const SequenceChunk> chunks, Logits which,
    dispatch::DispatchedModel* dispatched) {
  absl::StatusOr<std::unique_ptr<PendingLogits>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ACCEL_RETURN_IF_ERROR(SendStep(input_ids, chunks, which));
    pending =
        shard_->Submit(input_ids, chunks, which, dispatched != nullptr ? dispatched : dispatched_);
  }
  if (!pending.ok()) return Failed(pending.status());
  // The logits are waited for without the lock: heartbeats and the next
  // step's message go on meanwhile (behind this step's, in order).
  return std::make_unique<PendingLogits>(
      [this, shard_pending = std::shared_ptr<PendingLogits>(
                 *std::move(pending))]() -> absl::StatusOr<at::Tensor> {
        absl::StatusOr<at::Tensor> logits = shard_pending->Wait();
        if (!logits.ok()) return Failed(logits.status());
        return logits;
      });
}

int TensorParallelLeader::pipeline_size() const { return shard_->pipeline_size(); }
int64_t TensorParallelLeader::recompute_after() const { return shard_->recompute_after(); }

absl::Status TensorParallelLeader::Heartbeat() {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_ || stopped_) {
    return absl::UnavailableError("tensor parallel: the worker ranks are gone");
  }
  Writer w;
  w.Put(MessageKind::kHeartbeat);
  return Send(w.Take());
}

absl::Status TensorParallelLeader::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_ || broken_) return absl::OkStatus();
  stopped_ = true;
  wake_.notify_all();
  Writer w;
  w.Put(MessageKind::kStop);
  return Send(w.Take());
}

// The leader's next message to this rank, point to point (pipeline
// parallel: TensorParallelLeader::Send): its size, then its bytes.
absl::StatusOr<std::string> ReceiveMessage(dist::ProcessGroup& group) {
  c10::InferenceMode normal(false);  // gloo fills the buffers on its own threads
  at::Tensor size = at::zeros({1}, at::kLong);
  if (absl::Status got = group.Recv(size, 0); !got.ok()) return got;
  const int64_t n = size.item<int64_t>();
  // A step message holds ids, block tables and, for a LongRoPE sequence
  // crossing its context, its ids: far below 1 GiB. A size past that is a
  // corrupt stream, refused before anything is allocated for it.
  if (n < 1 || n > (int64_t{1} << 30)) {
    return absl::InternalError(absl::StrCat("tensor parallel worker: a message of ", n, " bytes"));
  }
  at::Tensor bytes = at::empty({n}, at::kByte);
  if (absl::Status got = group.Recv(bytes, 0); !got.ok()) return got;
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

absl::Status RunTensorParallelWorker(CausalLM& shard, dispatch::DispatchedModel* dispatched,
                                     dist::ProcessGroup& group) {
  std::unique_ptr<KvBlockStore> store;
  const size_t layers = static_cast<size_t>(shard.config().num_hidden_layers);
  const bool point_to_point = shard.pipeline_size() > 1;
  while (true) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::string> message =
        point_to_point ? ReceiveMessage(group) : group.BroadcastBytes("", 0);
    internal::AddCollectiveNanos(NanosSince(start));
    if (!message.ok()) {
      return RecordFault(absl::UnavailableError(
          absl::StrCat("tensor parallel worker rank ", group.rank(),
                       ": waiting for the leader's next step failed (the leader died or went "
                       "silent): ",
                       message.status().message())));
    }
    Reader r(*message);
    MessageKind kind;
    if (!r.Get(kind)) return absl::InternalError("tensor parallel worker: an empty message");
    if (kind == MessageKind::kStop) return absl::OkStatus();
    if (kind == MessageKind::kHeartbeat) continue;
    if (kind != MessageKind::kStep) {
      return absl::InternalError(
          absl::StrCat("tensor parallel worker: unknown message kind ", static_cast<int>(kind)));
    }
    uint8_t which = 0;
    std::vector<int64_t> ids;
    int64_t count = 0;
    bool ok = r.Get(which) && r.GetArray(ids) && r.Get(count) && count >= 0;
    std::vector<KvCache> caches(ok ? static_cast<size_t>(count) : 0);
    std::vector<SequenceChunk> chunks(caches.size());
    for (size_t i = 0; ok && i < caches.size(); ++i) {
      uint8_t has_cache = 0;
      ok = r.Get(chunks[i].tokens) && r.Get(chunks[i].logit_tokens) && r.Get(has_cache);
      if (!ok || has_cache == 0) continue;
      int64_t num_blocks = 0, block_size = 0;
      uint8_t has_ids = 0;
      ok = r.Get(caches[i].length) && r.Get(num_blocks) && r.Get(block_size) &&
           r.GetArray(caches[i].block_table) && num_blocks > 0 && block_size > 0 &&
           r.Get(has_ids) && (has_ids == 0 || r.GetArray(caches[i].token_ids));
      if (!ok) break;
      if (store == nullptr || store->num_blocks() != num_blocks ||
          store->block_size() != block_size) {
        store = std::make_unique<KvBlockStore>(num_blocks, block_size, layers);
      }
      caches[i].store = store.get();
      chunks[i].cache = &caches[i];
    }
    if (!ok || !r.done() || which > static_cast<uint8_t>(Logits::kLastOfEach)) {
      return absl::InternalError("tensor parallel worker: a malformed step message");
    }
    at::Tensor input;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { input = at::tensor(ids, at::kLong); }));
    absl::StatusOr<at::Tensor> logits;
    {
      c10::InferenceMode inference;
      logits = shard.Forward(input, chunks, static_cast<Logits>(which), dispatched);
    }
    if (!logits.ok() && !BeforeCollectives(logits.status())) {
      return RecordFault(
          Annotate(logits.status(), absl::StrCat("tensor parallel worker rank ", group.rank())));
    }
  }
}

double TensorParallelCollectiveSeconds() { return internal::CollectiveSeconds(); }
int64_t PipelineMicroBatchesRun() { return internal::MicroBatchesRun(); }
int64_t TensorParallelCollectiveBytes() { return internal::CollectiveBytes(); }

TensorParallelTraffic TensorParallelTrafficPerToken(const loader::ModelConfig& config,
                                                    at::ScalarType dtype, int size, int stages) {
  TensorParallelTraffic t;
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  if (stages > 1) {
    t.stage_send_bytes = config.hidden_size * element;
    t.logits_bytes = config.vocab_size * static_cast<int64_t>(sizeof(float));
  }
  if (size <= 1) return t;
  const int64_t stride = (config.vocab_size + size - 1) / size;
  const auto [first, last] = PipelineLayers(config.num_hidden_layers, 0, std::max(stages, 1));
  // The embedding's all-reduce, two a layer (attention, MLP), the logits'
  // gather (on the last stage).
  t.all_reduces = 1 + 2 * (last - first);
  const int64_t gathered = stages > 1 ? 0 : stride * element;
  t.payload_bytes = t.all_reduces * config.hidden_size * element + gathered;
  const double ring = 2.0 * (size - 1) / size;
  t.wire_bytes = ring * static_cast<double>(t.all_reduces * config.hidden_size * element) +
                 static_cast<double>(stages > 1 ? 0 : (size - 1) * stride * element);
  return t;
}

}  // namespace accel::models
