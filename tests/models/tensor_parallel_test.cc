// Tensor parallel: the configurations refused by name, each rank's slice of
// the checkpoint against the whole model's tensors, and greedy tokens of
// real ranks (processes over gloo on 127.0.0.1) against one process.
#include "models/tensor_parallel.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <unistd.h>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorIndexing.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

#include "core/status.h"
#include "dist/env.h"
#include "dist/process_group.h"
#include "models/families.h"
#include "models/load_model.h"
#include "models/make_model.h"
#include "tests/testing/multiprocess.h"
#include "tests/testing/process_memory.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::models {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::Each;
using ::testing::HasSubstr;
using ::testing::Optional;

loader::ModelConfig Config(MakeModelOptions o) {
  absl::StatusOr<loader::ModelConfig> c = MakeModelConfig(o);
  EXPECT_THAT(c, IsOk());
  return c.ok() ? *c : loader::ModelConfig();
}

// Each rank's slice of a row-parallel layer's input (2 of 4 heads of 32, half
// of 256) is a whole number of 4-bit blocks (64), so nf4 blocks are the
// whole model's, as in real models (4096 / 8 = 512).
MakeModelOptions Small(const std::string& family) {
  MakeModelOptions o;
  o.family = family;
  o.hidden_size = 128;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.intermediate_size = 256;
  o.vocab_size = 301;  // not divisible by 2: the last slice is padded
  o.num_layers = 2;
  o.num_experts = 4;
  o.moe_intermediate_size = 64;
  o.shared_expert_intermediate_size = 128;
  o.seed = 7;
  return o;
}

TEST(CheckTensorParallel, RefusesWhatCannotSplitByName) {
  MakeModelOptions o = Small("llama");
  EXPECT_THAT(CheckTensorParallel(Config(o), 2), IsOk());
  EXPECT_THAT(CheckTensorParallel(Config(o), 1), IsOk());
  EXPECT_THAT(CheckTensorParallel(Config(o), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least 1")));
  EXPECT_THAT(CheckTensorParallel(Config(o), 8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_attention_heads (4)")));
  o.num_heads = 6;
  o.num_kv_heads = 3;
  o.hidden_size = 96;
  EXPECT_THAT(CheckTensorParallel(Config(o), 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_key_value_heads (3)")));
  o = Small("llama");
  o.intermediate_size = 250;
  EXPECT_THAT(CheckTensorParallel(Config(o), 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("intermediate_size (250)")));
  o = Small("mixtral");
  o.num_experts = 6;
  EXPECT_THAT(CheckTensorParallel(Config(o), 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_local_experts (6)")));
  o = Small("qwen3_moe");
  o.num_experts = 6;
  EXPECT_THAT(CheckTensorParallel(Config(o), 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_experts (6)")));
  o = Small("qwen2_moe");
  o.shared_expert_intermediate_size = 130;
  EXPECT_THAT(CheckTensorParallel(Config(o), 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shared_expert_intermediate_size (130)")));
  // GPT-2 splits as the others do, and is refused by the same fields.
  o = Small("gpt2");
  EXPECT_THAT(CheckTensorParallel(Config(o), 2), IsOk());
  EXPECT_THAT(CheckTensorParallel(Config(o), 8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_attention_heads (4)")));
  o.intermediate_size = 250;
  EXPECT_THAT(CheckTensorParallel(Config(o), 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("intermediate_size (250)")));
  // LongRoPE models split too (a recomputed sequence's ids go with its step).
  o = Small("phi3");
  o.longrope_factor = 4;
  EXPECT_THAT(CheckTensorParallel(Config(o), 2), IsOk());
  // The model itself refuses the same way.
  o = Small("llama");
  TensorParallel tp;
  tp.size = 8;
  EXPECT_THAT(BuildCausalLM(Config(o), at::kFloat, tp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_attention_heads")));
}

TEST(ShardShapeFor, FewerKeyValueHeadsThanRanksAreReplicated) {
  MakeModelOptions o = Small("llama");
  o.num_heads = 8;
  o.num_kv_heads = 2;
  for (int rank = 0; rank < 4; ++rank) {
    absl::StatusOr<ShardShape> s = ShardShapeFor(Config(o), rank, 4);
    ASSERT_THAT(s, IsOk());
    EXPECT_EQ(s->heads, 2);
    EXPECT_EQ(s->first_head, 2 * rank);
    EXPECT_EQ(s->kv_heads, 1);
    // Query heads 0-3 read key/value head 0, heads 4-7 head 1.
    EXPECT_EQ(s->first_kv_head, rank / 2);
  }
  // 301 rows over 2 ranks: 151 and 150, both padded to 151 for the gather.
  absl::StatusOr<ShardShape> last = ShardShapeFor(Config(Small("llama")), 1, 2);
  ASSERT_THAT(last, IsOk());
  EXPECT_EQ(last->first_vocab, 151);
  EXPECT_EQ(last->vocab, 150);
  EXPECT_EQ(last->vocab_stride, 151);
}

// The named parameters of a loaded model, on the cpu.
std::map<std::string, at::Tensor> Parameters(LoadedModel& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.model->named_parameters(true)) out[p.key()] = p.value();
  return out;
}

LoadedModel Load(const std::string& dir, int rank, int size, const std::string& quantize = "none",
                 dist::ProcessGroup* group = nullptr) {
  ModelLoadOptions options;
  options.device_map = "cpu";
  options.progress = Progress::Style::kSilent;
  options.quantize = quantize;
  options.tensor_parallel.rank = rank;
  options.tensor_parallel.size = size;
  options.tensor_parallel.group = group;
  absl::StatusOr<LoadedModel> loaded = LoadModel(dir, options);
  EXPECT_THAT(loaded, IsOk()) << dir;
  return loaded.ok() ? *std::move(loaded) : LoadedModel();
}

// Each rank's slices, put back together as the test reads Megatron's split
// (heads of q/k/v and o's columns, the MLP's width, experts by index, vocab
// rows), are the whole model's tensors.
TEST(ShardingHook, EachRankHoldsItsSliceOfTheCheckpoint) {
  for (const char* family : {"llama", "mixtral", "qwen2_moe", "phi3"}) {
    SCOPED_TRACE(family);
    TempDir dir;
    MakeModelOptions o = Small(family);
    o.attention_bias = true;  // llama: o_proj has a bias, held by rank 0 alone
    ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
    LoadedModel whole = Load(dir.path(), 0, 1);
    LoadedModel r0 = Load(dir.path(), 0, 2), r1 = Load(dir.path(), 1, 2);
    ASSERT_TRUE(whole.model && r0.model && r1.model);
    std::map<std::string, at::Tensor> w = Parameters(whole), a = Parameters(r0), b = Parameters(r1);
    const int64_t d = 32;  // 128 / 4 heads
    for (const auto& [name, full] : w) {
      SCOPED_TRACE(name);
      const std::vector<std::string> parts = absl::StrSplit(name, '.');
      const std::string proj = parts.size() >= 2 ? parts[parts.size() - 2] : "";
      if (name.find(".experts.") != std::string::npos) {
        // Experts 0-1 on rank 0, 2-3 on rank 1 as its 0-1.
        const int e = std::stoi(parts[5]);
        std::vector<std::string> local = parts;
        local[5] = std::to_string(e % 2);
        const std::string mine = absl::StrJoin(local, ".");
        const auto& holder = e < 2 ? a : b;
        const auto& other = e < 2 ? b : a;
        ASSERT_TRUE(holder.count(mine)) << mine;
        EXPECT_TRUE(at::equal(holder.at(mine), full));
        EXPECT_FALSE(other.count(mine) && at::equal(other.at(mine), full));
        continue;
      }
      ASSERT_TRUE(a.count(name) && b.count(name));
      const at::Tensor &x = a.at(name), &y = b.at(name);
      if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
        EXPECT_TRUE(at::equal(at::cat({x, y}), full));
        EXPECT_EQ(x.size(0), 151);
      } else if (proj == "q_proj") {
        // 4 query heads: 0-1 on rank 0, 2-3 on rank 1.
        EXPECT_TRUE(at::equal(at::cat({x, y}), full));
        EXPECT_EQ(x.size(0), 2 * d);
      } else if (proj == "k_proj" || proj == "v_proj") {
        EXPECT_TRUE(at::equal(x, full.narrow(0, 0, d)));  // kv head 0 for heads 0-1
        EXPECT_TRUE(at::equal(y, full.narrow(0, d, d)));
      } else if (proj == "o_proj" && parts.back() == "weight") {
        EXPECT_TRUE(at::equal(at::cat({x, y}, 1), full));
      } else if (proj == "o_proj") {
        EXPECT_TRUE(at::equal(x, full));
        EXPECT_TRUE(at::equal(y, at::zeros_like(full)));
      } else if (proj == "qkv_proj") {
        // [q heads 0-3 | k heads 0-1 | v heads 0-1]: rank 1 holds q 2-3, k 1, v 1.
        EXPECT_TRUE(at::equal(y, at::cat({full.narrow(0, 2 * d, 2 * d), full.narrow(0, 5 * d, d),
                                          full.narrow(0, 7 * d, d)})));
      } else if (proj == "gate_up_proj") {
        const int64_t i = full.size(0) / 2;
        EXPECT_TRUE(at::equal(
            y, at::cat({full.narrow(0, i / 2, i / 2), full.narrow(0, i + i / 2, i / 2)})));
      } else if (proj == "gate_proj" || proj == "up_proj") {
        EXPECT_TRUE(at::equal(at::cat({x, y}), full));
      } else if (proj == "down_proj") {
        EXPECT_TRUE(at::equal(at::cat({x, y}, 1), full));
      } else {
        // Norms, routers, the shared expert's gate: replicated.
        EXPECT_TRUE(at::equal(x, full));
        EXPECT_TRUE(at::equal(y, full));
      }
    }
  }
}

// GPT-2's Conv1D layers store W [in, out]: each rank's c_attn holds its
// heads' columns of each of the q, k and v thirds (and those entries of the
// bias), attn.c_proj and mlp.c_proj their rows (biases on rank 0 alone),
// mlp.c_fc its columns; wte splits by vocabulary rows (301: 151 and 150),
// wpe and the LayerNorms are whole on both.
TEST(ShardingHook, Gpt2Conv1DLayersSplitByColumnsAndRows) {
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), Small("gpt2")), IsOk());
  LoadedModel whole = Load(dir.path(), 0, 1);
  LoadedModel r0 = Load(dir.path(), 0, 2), r1 = Load(dir.path(), 1, 2);
  ASSERT_TRUE(whole.model && r0.model && r1.model);
  std::map<std::string, at::Tensor> w = Parameters(whole), a = Parameters(r0), b = Parameters(r1);
  const int64_t d = 32, hidden = 128, half = 64;  // 4 heads of 32: 2 a rank
  int checked_c_attn = 0, checked_biases = 0;
  for (const auto& [name, full] : w) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(a.count(name) && b.count(name));
    const at::Tensor &x = a.at(name), &y = b.at(name);
    const std::vector<std::string> parts = absl::StrSplit(name, '.');
    const std::string proj = parts.size() >= 2 ? parts[parts.size() - 2] : "";
    const std::string block = parts.size() >= 3 ? parts[parts.size() - 3] : "";
    const bool weight = parts.back() == "weight";
    if (name == "transformer.wte.weight" || name == "lm_head.weight") {
      EXPECT_TRUE(at::equal(at::cat({x, y}), full));
      EXPECT_EQ(x.size(0), 151);
    } else if (proj == "c_attn") {
      // [q | k | v], 128 each; rank 1: heads 2-3 of each.
      const int64_t dim = weight ? 1 : 0;
      for (int rank = 0; rank < 2; ++rank) {
        std::vector<at::Tensor> thirds;
        for (int third = 0; third < 3; ++third) {
          thirds.push_back(full.narrow(dim, third * hidden + rank * 2 * d, 2 * d));
        }
        EXPECT_TRUE(at::equal(rank == 0 ? x : y, at::cat(thirds, dim)));
      }
      ++checked_c_attn;
    } else if (block == "mlp" && proj == "c_fc") {
      const int64_t dim = weight ? 1 : 0;
      EXPECT_TRUE(at::equal(at::cat({x, y}, dim), full));
      EXPECT_EQ(x.size(dim), 128);
    } else if (proj == "c_proj" && weight) {
      // Row-parallel: rows of [in, out].
      EXPECT_TRUE(at::equal(at::cat({x, y}), full));
      EXPECT_EQ(x.size(0), block == "attn" ? half : 128);
    } else if (proj == "c_proj") {
      // Added once, after the all-reduce.
      EXPECT_GT(full.abs().sum().item<double>(), 0);
      EXPECT_TRUE(at::equal(x, full));
      EXPECT_TRUE(at::equal(y, at::zeros_like(full)));
      ++checked_biases;
    } else {
      // wpe, ln_1, ln_2, ln_f: replicated.
      EXPECT_TRUE(at::equal(x, full));
      EXPECT_TRUE(at::equal(y, full));
    }
  }
  EXPECT_EQ(checked_c_attn, 4);  // 2 layers, weight and bias
  EXPECT_EQ(checked_biases, 4);  // 2 layers, attn and mlp
}

// A rank keeps resident only its own slices of the checkpoint, with every
// other rank's slices in the page cache beside them (as on one machine):
// the row slices it uses in place are mapped on their own (a fault on the
// whole file's mapping maps the page cache's whole folio around the page,
// 1 MiB on Linux 6.18 / ext4, other ranks' rows with it: 4 MiB MLP tensors
// here; an expert it holds, whole, beside the other rank's), and the pages
// of tensors it copied (column slices) are dropped.
TEST(ShardingHook, ARankKeepsOnlyItsSlicesOfTheCheckpointResident) {
  for (const char* family : {"llama", "mixtral"}) {  // mixtral: experts 0-1 and 2-3 interleaved
    SCOPED_TRACE(family);
    TempDir dir;
    MakeModelOptions o = Small(family);
    o.hidden_size = 512;
    o.num_heads = 8;
    o.num_kv_heads = 4;
    o.intermediate_size = 2048;  // float32 gate / up: 4 MiB, 2 MiB a rank
    ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
    const std::string root = std::filesystem::canonical(dir.path()).string() + "/";
    for (const auto& e : std::filesystem::directory_iterator(root)) {
      std::ifstream in(e.path(), std::ios::binary);  // the whole file in the page cache
      std::string sink((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    }
    for (int rank = 0; rank < 2; ++rank) {
      SCOPED_TRACE(rank);
      LoadedModel loaded = Load(dir.path(), rank, 2);
      ASSERT_TRUE(loaded.model);
      // Every weight read once, as a step reads it.
      double sum = 0;
      for (const auto& [name, t] : Parameters(loaded)) sum += t.to(at::kFloat).sum().item<double>();
      EXPECT_TRUE(std::isfinite(sum));
      const std::vector<test::Mapping> mappings = test::ReadMappings();
      int64_t used_in_place = 0, tensors = 0;
      for (const auto& [name, t] : Parameters(loaded)) {
        const auto at = reinterpret_cast<uintptr_t>(t.data_ptr());
        for (const test::Mapping& m : mappings) {
          if (m.begin <= at && at < m.end && m.path.compare(0, root.size(), root) == 0) {
            used_in_place += static_cast<int64_t>(t.nbytes());
            ++tensors;
          }
        }
      }
      const int64_t page = ::sysconf(_SC_PAGESIZE);
      const int64_t resident = test::ResidentBytesOfFilesUnder(mappings, root);
      EXPECT_GT(tensors, 0);  // the row slices are the file's own bytes
      // Its slices' pages, and of the rest of the file no more than the pages
      // the header and each tensor's ends share with a neighbour (the pages
      // wholly inside a tensor it copied are dropped).
      const int64_t header = int64_t{8} << 10,
                    ends = 2 * page * static_cast<int64_t>(Parameters(loaded).size());
      EXPECT_GE(resident, used_in_place);
      EXPECT_LE(resident, used_in_place + 2 * page * tensors + header + ends);
    }
  }
}

// ---------------------------------------------------------------------------
// Real ranks. Rank 0 runs greedy decoding of two prompts (packed together,
// paged KV) through a TensorParallelLeader and compares the tokens with the
// whole model in its own process; rank 1 runs RunTensorParallelWorker.

constexpr int kNewTokens = 8;

// Greedy decoding of two prompts together, on paged caches: each step's
// tokens and logits [2, vocab]. `last_step_bytes`: what the last step handed
// to collectives.
struct GreedyRun {
  std::vector<std::vector<int64_t>> tokens{2};
  std::vector<at::Tensor> logits;
};

GreedyRun Greedy(CausalLM& model, dispatch::DispatchedModel* dispatched,
                 int64_t* last_step_bytes = nullptr, int64_t* store_bytes = nullptr) {
  c10::InferenceMode inference;
  KvBlockStore store(/*num_blocks=*/16, /*block_size=*/4,
                     static_cast<size_t>(model.config().num_hidden_layers));
  std::vector<std::vector<int64_t>> prompts = {{5, 17, 42, 99, 3, 250, 7}, {300, 1, 2}};
  std::vector<KvCache> caches(2);
  for (int s = 0; s < 2; ++s) {
    caches[s].store = &store;
    for (int b = 0; b < 8; ++b) caches[s].block_table.push_back(8 * s + b);
  }
  GreedyRun out;
  std::vector<int64_t> ids = prompts[0];
  ids.insert(ids.end(), prompts[1].begin(), prompts[1].end());
  std::vector<SequenceChunk> chunks = {{&caches[0], 7}, {&caches[1], 3}};
  for (int step = 0; step < kNewTokens; ++step) {
    const int64_t before = TensorParallelCollectiveBytes();
    absl::StatusOr<at::Tensor> logits =
        model.Forward(at::tensor(ids, at::kLong), chunks, Logits::kLastOfEach, dispatched);
    EXPECT_THAT(logits, IsOk());
    if (!logits.ok()) return {};
    if (last_step_bytes != nullptr) *last_step_bytes = TensorParallelCollectiveBytes() - before;
    out.logits.push_back(*logits);
    at::Tensor next = logits->argmax(-1);
    ids = {next[0].item<int64_t>(), next[1].item<int64_t>()};
    out.tokens[0].push_back(ids[0]);
    out.tokens[1].push_back(ids[1]);
    chunks = {{&caches[0], 1}, {&caches[1], 1}};
  }
  if (store_bytes != nullptr) *store_bytes = store.bytes();
  return out;
}

// Tensor-parallel greedy decoding against one process's. float32: the same
// tokens. 16-bit: each rank rounds its partial sums to the model's dtype
// before the all-reduce, so logits differ from one process's in the last
// bits; each sequence's logits must stay within a bound of the single
// process's while their tokens agree (sequences are independent), and
// where a token differs, the single process's best two logits there must
// be within the observed difference of each other (a near tie, decided by
// rounding), never a real disagreement.
void ExpectSameGreedy(const GreedyRun& parallel, const GreedyRun& single, bool exact,
                      int64_t layers) {
  ASSERT_EQ(parallel.logits.size(), static_cast<size_t>(kNewTokens));
  ASSERT_EQ(single.logits.size(), static_cast<size_t>(kNewTokens));
  if (exact) {
    EXPECT_EQ(parallel.tokens, single.tokens);
    return;
  }
  for (int q = 0; q < 2; ++q) {
    for (int s = 0; s < kNewTokens; ++s) {
      const at::Tensor a = parallel.logits[s][q], b = single.logits[s][q];
      const double diff = (a - b).abs().max().item<double>();
      const double scale = b.abs().max().item<double>();
      // About 4 roundings to bfloat16 (2^-8 each) of the largest logit a
      // layer: its two all-reduces' partial sums, and what they feed. (On an
      // AVX2 machine gpt2 once differed by 4.2 a layer, when its bfloat16
      // products ran through libtorch's one-thread loop; since they run in
      // float32 rounded once, 0.004-0.006 against this bound's 0.024.) A
      // wrong shard or a missing all-reduce differs by the logits' size.
      EXPECT_LE(diff, 4.0 * static_cast<double>(layers) * std::ldexp(1.0, -8) * scale)
          << "sequence " << q << " step " << s;
      if (parallel.tokens[q][s] != single.tokens[q][s]) {
        const at::Tensor top = std::get<0>(b.topk(2));
        const double margin = (top[0] - top[1]).item<double>();
        std::printf(
            "sequence %d: tokens part at step %d, a near tie (margin %g, logits differ "
            "by at most %g)\n",
            q, s, margin, diff);
        EXPECT_LE(margin, 2 * diff) << "sequence " << q << " step " << s;
        break;
      }
    }
  }
}

// Bytes of a model's parameters and buffers (a tied head's weight, the
// embedding's own tensor, once).
int64_t ParameterBytes(torch::nn::Module& m) {
  int64_t bytes = 0;
  std::set<const void*> seen;
  for (const at::Tensor& p : m.parameters(true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) bytes += static_cast<int64_t>(p.nbytes());
  }
  for (const at::Tensor& b : m.buffers(true)) bytes += static_cast<int64_t>(b.nbytes());
  return bytes;
}

// This worker process's group of every rank (test::RunRanks' environment),
// each collective bounded by `timeout`.
absl::StatusOr<std::unique_ptr<dist::ProcessGroup>> ConnectWorld(absl::Duration timeout) {
  ACCEL_ASSIGN_OR_RETURN(dist::ProcessEnvironment env,
                         dist::DetectProcessEnvironment(dist::ProcessEnv()));
  dist::ProcessGroupOptions options;
  options.timeout = timeout;
  return dist::ProcessGroup::Connect(env, options);
}

// A worker of a size x stages run (ACCEL_TP_SIZE ranks a stage): its world
// and its place in the tensor parallel and pipeline groups.
struct StagedRank {
  std::unique_ptr<dist::ProcessGroup> world;
  std::unique_ptr<dist::ProcessGroup> stage_group;
  TensorParallel parallel;
  int size = 1;
};

absl::StatusOr<StagedRank> JoinStagedRank() {
  StagedRank joined;
  ACCEL_ASSIGN_OR_RETURN(joined.world, ConnectWorld(absl::Seconds(60)));
  joined.size = std::atoi(std::getenv("ACCEL_TP_SIZE"));
  ACCEL_ASSIGN_OR_RETURN(joined.parallel,
                         JoinParallelGroups(*joined.world, joined.size, &joined.stage_group));
  return joined;
}

TEST(TensorParallelRank, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of TensorParallel.*";
  absl::StatusOr<std::unique_ptr<dist::ProcessGroup>> group = ConnectWorld(absl::Seconds(60));
  ASSERT_THAT(group, IsOk());
  const int rank = (*group)->rank(), size = (*group)->size();
  // ACCEL_TP_CASES: "dir:quantize" entries separated by ','.
  for (absl::string_view item : absl::StrSplit(std::getenv("ACCEL_TP_CASES"), ',')) {
    const std::vector<std::string> fields = absl::StrSplit(item, ':');
    SCOPED_TRACE(item);
    LoadedModel shard = Load(fields[0], rank, size, fields[1], group->get());
    ASSERT_TRUE(shard.model);
    if (rank != 0) {
      EXPECT_THAT(RunTensorParallelWorker(*shard.model, shard.dispatched.get(), **group), IsOk());
      continue;
    }
    // Rank 0's model drives the others.
    auto* leader_model = dynamic_cast<TensorParallelLeader*>(shard.model.get());
    ASSERT_NE(leader_model, nullptr);
    TensorParallelLeader& leader = *leader_model;
    {
      // Refused before anything is sent: a contiguous cache.
      c10::InferenceMode inference;
      KvCache contiguous;
      EXPECT_THAT(
          leader.Forward(at::tensor({1, 2}, at::kLong), {{&contiguous, 2}}, Logits::kAll, nullptr),
          StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("paged KV caches")));
      // Refused on every rank before any collective: an id past the vocabulary.
      EXPECT_THAT(
          leader.Forward(at::tensor({1, 4000}, at::kLong), {{nullptr, 2}}, Logits::kAll, nullptr),
          StatusIs(absl::StatusCode::kInvalidArgument));
      EXPECT_THAT(leader.Heartbeat(), IsOk());
    }
    int64_t decode_bytes = 0;
    const GreedyRun parallel = Greedy(leader, nullptr, &decode_bytes);
    // A decode step of two tokens: twice what one token costs on paper.
    EXPECT_EQ(decode_bytes,
              2 * TensorParallelTrafficPerToken(shard.config, shard.dtype, size).payload_bytes);
    EXPECT_TRUE(leader.healthy());
    EXPECT_THAT(leader.Stop(), IsOk());
    LoadedModel whole = Load(fields[0], 0, 1, fields[1]);
    ASSERT_TRUE(whole.model);
    const GreedyRun single = Greedy(*whole.model, whole.dispatched.get());
    ExpectSameGreedy(parallel, single, shard.dtype == at::kFloat, shard.config.num_hidden_layers);
    // Each rank holds about half of the weights (norms and routers are whole).
    const double share = static_cast<double>(ParameterBytes(*shard.model)) /
                         static_cast<double>(ParameterBytes(*whole.model));
    std::printf("%s: rank 0 holds %.1f%% of the weights' bytes\n", std::string(item).c_str(),
                100 * share);
    EXPECT_LT(share, 0.55);
    // What the planner sizes (accel-estimate-memory, device maps) is what the rank holds.
    absl::StatusOr<dispatch::ModuleTree> tree =
        ModuleTreeFor(shard.config, shard.dtype, rank, size);
    ASSERT_THAT(tree, IsOk());
    if (fields[1] == "none") {
      EXPECT_EQ(dispatch::ComputeModuleSizes(*tree).total(),
                static_cast<double>(ParameterBytes(*shard.model)));
    }
  }
  EXPECT_GT(TensorParallelCollectiveSeconds(), 0);
}

TEST(TensorParallel, TwoRanksDecodeAsOneProcess) {
  TempDir dir;
  std::vector<std::string> cases;
  for (const char* family : {"llama", "mixtral", "qwen3_moe", "gpt2"}) {
    for (const char* dtype : {"bfloat16", "float32"}) {
      MakeModelOptions o = Small(family);
      o.dtype = std::string(dtype) == "bfloat16" ? at::kBFloat16 : at::kFloat;
      // GPT-2's learned positions are replicated: no more of them than the
      // test reaches, so that a rank's share stays about half, as at scale
      // (1024 positions beside 124M parameters).
      if (std::string(family) == "gpt2") o.max_position_embeddings = 64;
      const std::string path = absl::StrCat(dir.path(), "/", family, "-", dtype);
      ASSERT_THAT(MakeModel(path, o), IsOk());
      cases.push_back(absl::StrCat(path, ":none"));
      if (o.dtype == at::kBFloat16) cases.push_back(absl::StrCat(path, ":nf4"));
    }
  }
  EXPECT_THAT(test::RunRanks(2, "TensorParallelRank.Run",
                             {{"ACCEL_TP_CASES", absl::StrJoin(cases, ",")}}, /*timeout_s=*/120),
              Each(0));
}

// A worker (a tensor-parallel rank or the second pipeline stage) that dies
// (killed) or stops answering (SIGSTOP): the leader's step fails with
// Unavailable within the group's timeout, and so does every
// later step and heartbeat, at once. Never a hang.
TEST(TensorParallelFailureRank, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of TensorParallel.*";
  absl::StatusOr<std::unique_ptr<dist::ProcessGroup>> group = ConnectWorld(absl::Seconds(3));
  ASSERT_THAT(group, IsOk());
  const int rank = (*group)->rank();
  absl::StatusOr<std::vector<std::string>> pids =
      (*group)->AllGatherBytes(std::to_string(::getpid()));
  ASSERT_THAT(pids, IsOk());
  // ACCEL_TP_SIZE 1: two pipeline stages instead of two tensor-parallel ranks.
  std::unique_ptr<dist::ProcessGroup> stage_group;
  absl::StatusOr<TensorParallel> place =
      JoinParallelGroups(**group, std::atoi(std::getenv("ACCEL_TP_SIZE")), &stage_group);
  ASSERT_THAT(place, IsOk());
  ModelLoadOptions load;
  load.device_map = "cpu";
  load.progress = Progress::Style::kSilent;
  load.tensor_parallel = *place;
  absl::StatusOr<LoadedModel> loaded = LoadModel(std::getenv("ACCEL_TP_MODEL"), load);
  ASSERT_THAT(loaded, IsOk());
  LoadedModel& shard = *loaded;
  ASSERT_TRUE(shard.model);
  if (rank != 0) {
    // Runs until the leader kills it (or, stopped and then killed, never returns).
    (void)RunTensorParallelWorker(*shard.model, shard.dispatched.get(), **group);
    std::_Exit(3);
  }
  auto* leader_model = dynamic_cast<TensorParallelLeader*>(shard.model.get());
  ASSERT_NE(leader_model, nullptr);
  TensorParallelLeader& leader = *leader_model;
  c10::InferenceMode inference;
  const pid_t worker = std::stoi((*pids)[1]);
  ASSERT_EQ(Greedy(leader, nullptr).tokens[0].size(), static_cast<size_t>(kNewTokens));
  const std::string how = std::getenv("ACCEL_TP_FAILURE");
  ::kill(worker, how == "stop" ? SIGSTOP : SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  KvCache cache;
  KvBlockStore store(4, 4, static_cast<size_t>(shard.config.num_hidden_layers));
  cache.store = &store;
  cache.block_table = {0, 1};
  EXPECT_THAT(
      leader.Forward(at::tensor({1, 2, 3}, at::kLong), {{&cache, 3}}, Logits::kLastOfEach, nullptr),
      StatusIs(absl::StatusCode::kUnavailable));
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s worker: the step failed after %.2f s\n", how.c_str(), waited);
  EXPECT_LT(waited, 3 + 10);  // the group's timeout, and slack for a loaded machine
  EXPECT_FALSE(leader.healthy());
  EXPECT_THAT(TensorParallelFault(), Optional(HasSubstr("tensor parallel")));
  EXPECT_THAT(leader.Heartbeat(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(leader.Forward(at::tensor({1}, at::kLong), {{nullptr, 1}}, Logits::kAll, nullptr),
              StatusIs(absl::StatusCode::kUnavailable));
  if (how == "stop") ::kill(worker, SIGKILL);
  std::fflush(stdout);
  std::_Exit(::testing::Test::HasFailure() ? 1 : 0);  // the broken group's threads stay behind
}

TEST(TensorParallel, AKilledOrStoppedWorkerFailsTheStepWithinTheTimeout) {
  TempDir dir;
  MakeModelOptions o = Small("llama");
  ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
  // Two tensor-parallel ranks, then two pipeline stages (the step's send or
  // the logits' recv fails).
  for (const char* size : {"2", "1"}) {
    for (const char* how : {"kill", "stop"}) {
      SCOPED_TRACE(absl::StrCat(how, " tensor_parallel_size ", size));
      const std::vector<int> codes = test::RunRanks(
          2, "TensorParallelFailureRank.Run",
          {{"ACCEL_TP_MODEL", dir.path()}, {"ACCEL_TP_FAILURE", how}, {"ACCEL_TP_SIZE", size}}, 60);
      ASSERT_EQ(codes.size(), 2u);
      EXPECT_EQ(codes[0], 0);
      EXPECT_EQ(codes[1], 128 + SIGKILL);
    }
  }
}

// ---------------------------------------------------------------------------
// Pipeline parallel.

// vLLM's get_pp_indices: even, the remainder one each to the stages before
// the last, counting back from the second-to-last.
TEST(PipelineLayers, SplitsAsVllm) {
  using Range = std::pair<int64_t, int64_t>;
  const auto split = [](int64_t layers, int stages) {
    std::vector<Range> out;
    for (int s = 0; s < stages; ++s) out.push_back(PipelineLayers(layers, s, stages));
    return out;
  };
  EXPECT_EQ(split(20, 4), (std::vector<Range>{{0, 5}, {5, 10}, {10, 15}, {15, 20}}));
  EXPECT_EQ(split(10, 4), (std::vector<Range>{{0, 2}, {2, 5}, {5, 8}, {8, 10}}));
  EXPECT_EQ(split(7, 4), (std::vector<Range>{{0, 2}, {2, 4}, {4, 6}, {6, 7}}));
  EXPECT_EQ(split(3, 2), (std::vector<Range>{{0, 2}, {2, 3}}));
  EXPECT_EQ(split(2, 2), (std::vector<Range>{{0, 1}, {1, 2}}));
  EXPECT_EQ(split(5, 1), (std::vector<Range>{{0, 5}}));
}

// --pipeline_micro_batches 0 (auto): one per stage, none under 32 tokens, so
// decode steps of a few rows run whole and prefill chunks overlap.
TEST(PipelineMicroBatches, AutoSplitsOnlyStepsWithTokensEnough) {
  EXPECT_EQ(PipelineAutoMicroBatches(0, 2), 1);
  EXPECT_EQ(PipelineAutoMicroBatches(8, 2), 1);   // 8 decode rows
  EXPECT_EQ(PipelineAutoMicroBatches(63, 2), 1);  // two of 31: not worth a second weight read
  EXPECT_EQ(PipelineAutoMicroBatches(64, 2), 2);  // a 64-token prefill chunk
  EXPECT_EQ(PipelineAutoMicroBatches(512, 2), 2);
  EXPECT_EQ(PipelineAutoMicroBatches(100, 4), 3);
  EXPECT_EQ(PipelineAutoMicroBatches(4096, 4), 4);
  EXPECT_EQ(PipelineAutoMicroBatches(4096, 1), 1);
}

// The micro-batches of a step: contiguous, at least one chunk each, never
// more than the chunks, cut at equal shares of the tokens.
TEST(PipelineMicroBatches, SplitsTheStepsSequencesByTokens) {
  using Cuts = std::vector<std::pair<size_t, size_t>>;
  const auto cut = [](std::vector<int64_t> tokens, int requested) {
    return PipelineMicroBatches(tokens, requested);
  };
  EXPECT_EQ(cut({}, 2), Cuts{});
  // One sequence: the step as it is; 0 or 1 requested: the step as it is.
  EXPECT_EQ(cut({9}, 2), (Cuts{{0, 1}}));
  EXPECT_EQ(cut({1, 1, 1}, 1), (Cuts{{0, 3}}));
  EXPECT_EQ(cut({1, 1, 1}, 0), (Cuts{{0, 3}}));
  // Decodes: equal counts; an odd count puts the larger half first.
  EXPECT_EQ(cut({1, 1, 1, 1}, 2), (Cuts{{0, 2}, {2, 4}}));
  EXPECT_EQ(cut({1, 1, 1, 1, 1}, 2), (Cuts{{0, 3}, {3, 5}}));
  EXPECT_EQ(cut({1, 1, 1, 1, 1, 1}, 3), (Cuts{{0, 2}, {2, 4}, {4, 6}}));
  // Never more micro-batches than sequences.
  EXPECT_EQ(cut({1, 1}, 4), (Cuts{{0, 1}, {1, 2}}));
  EXPECT_EQ(cut({7, 3}, 2), (Cuts{{0, 1}, {1, 2}}));
  // A prefill chunk weighs its tokens: alone in its micro-batch, the
  // decodes together in the other.
  EXPECT_EQ(cut({100, 1, 1, 1}, 2), (Cuts{{0, 1}, {1, 4}}));
  EXPECT_EQ(cut({1, 1, 1, 100}, 2), (Cuts{{0, 3}, {3, 4}}));
  // The share is reached late: cut so that every micro-batch keeps a chunk.
  EXPECT_EQ(cut({1, 1, 100}, 3), (Cuts{{0, 1}, {1, 2}, {2, 3}}));
  EXPECT_EQ(cut({1, 100, 1, 1}, 3), (Cuts{{0, 2}, {2, 3}, {3, 4}}));
  // Against a plain restatement of the rule on many steps: contiguous,
  // covering, non-empty, min(requested, n) of them, and each cut (but the
  // forced ones) at the first chunk whose running total reaches its share.
  std::srand(3);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<int64_t> tokens(static_cast<size_t>(1 + std::rand() % 9));
    for (int64_t& t : tokens) t = 1 + std::rand() % (std::rand() % 2 ? 3 : 64);
    const int requested = 1 + std::rand() % 5;
    const Cuts got = PipelineMicroBatches(tokens, requested);
    const size_t k = std::min(tokens.size(), static_cast<size_t>(requested));
    ASSERT_EQ(got.size(), k);
    int64_t total = 0;
    for (int64_t t : tokens) total += t;
    size_t at = 0;
    int64_t so_far = 0;
    for (size_t b = 0; b < k; ++b) {
      ASSERT_EQ(got[b].first, at);
      ASSERT_GT(got[b].second, got[b].first);
      // Where the rule cuts: the share reached, or no chunk to spare.
      size_t end = at;
      int64_t sum = so_far;
      while (true) {
        sum += tokens[end++];
        const size_t left = tokens.size() - end, later = k - b - 1;
        if (left == later) break;
        if (later > 0 && sum * static_cast<int64_t>(k) >= total * static_cast<int64_t>(b + 1)) {
          break;
        }
      }
      EXPECT_EQ(got[b].second, end) << "trial " << trial << " micro-batch " << b;
      so_far = sum;
      at = got[b].second;
    }
    EXPECT_EQ(at, tokens.size());
  }
}

TEST(CheckPipelineParallel, RefusesWhatCannotSplitByName) {
  MakeModelOptions o = Small("llama");  // 2 layers
  EXPECT_THAT(CheckPipelineParallel(Config(o), 1), IsOk());
  EXPECT_THAT(CheckPipelineParallel(Config(o), 2), IsOk());
  EXPECT_THAT(
      CheckPipelineParallel(Config(o), 3),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("pipeline_parallel_size 3"), HasSubstr("num_hidden_layers (2)"))));
  EXPECT_THAT(CheckPipelineParallel(Config(o), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least 1")));
  o = Small("gpt2");
  EXPECT_THAT(CheckPipelineParallel(Config(o), 2), IsOk());
  EXPECT_THAT(CheckPipelineParallel(Config(o), 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_hidden_layers (2)")));
  o = Small("phi3");
  o.longrope_factor = 4;
  EXPECT_THAT(CheckPipelineParallel(Config(o), 2), IsOk());
  // The model itself refuses the same way, and a stage outside the pipeline.
  TensorParallel pp;
  pp.pipeline_size = 3;
  EXPECT_THAT(BuildCausalLM(Config(Small("llama")), at::kFloat, pp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_hidden_layers")));
  pp.pipeline_size = 2;
  pp.pipeline_rank = 2;
  EXPECT_THAT(BuildCausalLM(Config(Small("llama")), at::kFloat, pp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pipeline stage 2")));
}

// Whether any of `names` starts with `prefix`.
bool HasPrefix(const std::vector<std::string>& names, absl::string_view prefix) {
  for (const std::string& n : names) {
    if (absl::StartsWith(n, prefix)) return true;
  }
  return false;
}

// Each stage's module tree holds its layers only: the embedding on the
// first stage, the final norm and lm_head on the last (the embedding too
// when lm_head shares it).
TEST(PipelineParallel, EachStageHoldsItsLayers) {
  MakeModelOptions o = Small("llama");
  o.num_layers = 3;
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied);
    o.tie_word_embeddings = tied;
    std::vector<std::vector<std::string>> names(2);
    for (int stage = 0; stage < 2; ++stage) {
      TensorParallel pp;
      pp.pipeline_rank = stage;
      pp.pipeline_size = 2;
      absl::StatusOr<dispatch::ModuleTree> tree = ModuleTreeFor(Config(o), at::kFloat, pp);
      ASSERT_THAT(tree, IsOk());
      for (const auto& p : tree->NamedParameters()) names[stage].push_back(p.name);
    }
    // Layers 0-1 on stage 0, layer 2 on stage 1 (vLLM's split of 3 over 2).
    EXPECT_TRUE(HasPrefix(names[0], "model.layers.0.") && HasPrefix(names[0], "model.layers.1."));
    EXPECT_FALSE(HasPrefix(names[0], "model.layers.2."));
    EXPECT_TRUE(HasPrefix(names[1], "model.layers.2."));
    EXPECT_FALSE(HasPrefix(names[1], "model.layers.0.") || HasPrefix(names[1], "model.layers.1."));
    EXPECT_TRUE(HasPrefix(names[0], "model.embed_tokens."));
    EXPECT_FALSE(HasPrefix(names[0], "model.norm.") || HasPrefix(names[0], "lm_head."));
    EXPECT_TRUE(HasPrefix(names[1], "model.norm."));
    EXPECT_EQ(HasPrefix(names[1], "model.embed_tokens."), tied);
    EXPECT_EQ(HasPrefix(names[1], "lm_head."), !tied);  // tied: the embedding's tensor
  }
}

// GPT-2's stages: wte and wpe on the first, h.<i> as vLLM splits them, ln_f
// and wte (the tied head's tensor) on the last; the sharding hook skips
// the other stages' tensors unread.
TEST(PipelineParallel, Gpt2StagesHoldTheirBlocks) {
  MakeModelOptions o = Small("gpt2");
  o.num_layers = 3;
  TempDir dir;
  ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
  std::vector<std::vector<std::string>> names(2);
  for (int stage = 0; stage < 2; ++stage) {
    TensorParallel pp;
    pp.pipeline_rank = stage;
    pp.pipeline_size = 2;
    absl::StatusOr<dispatch::ModuleTree> tree = ModuleTreeFor(Config(o), at::kFloat, pp);
    ASSERT_THAT(tree, IsOk());
    for (const auto& p : tree->NamedParameters()) names[stage].push_back(p.name);
    // The loaded stage holds the same tensors, each equal to the whole model's.
    ModelLoadOptions load;
    load.device_map = "cpu";
    load.progress = Progress::Style::kSilent;
    load.tensor_parallel = pp;
    absl::StatusOr<LoadedModel> loaded = LoadModel(dir.path(), load);
    ASSERT_THAT(loaded, IsOk());
    LoadedModel whole = Load(dir.path(), 0, 1);
    ASSERT_TRUE(whole.model);
    const std::map<std::string, at::Tensor> all = Parameters(whole);
    for (const auto& [name, t] : Parameters(*loaded)) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(all.count(name));
      EXPECT_TRUE(at::equal(t, all.at(name)));
    }
  }
  EXPECT_TRUE(HasPrefix(names[0], "transformer.h.0.") && HasPrefix(names[0], "transformer.h.1."));
  EXPECT_FALSE(HasPrefix(names[0], "transformer.h.2."));
  EXPECT_TRUE(HasPrefix(names[1], "transformer.h.2."));
  EXPECT_FALSE(HasPrefix(names[1], "transformer.h.0.") || HasPrefix(names[1], "transformer.h.1."));
  EXPECT_TRUE(HasPrefix(names[0], "transformer.wte.") && HasPrefix(names[0], "transformer.wpe."));
  EXPECT_FALSE(HasPrefix(names[0], "transformer.ln_f."));
  EXPECT_TRUE(HasPrefix(names[1], "transformer.ln_f.") && HasPrefix(names[1], "transformer.wte."));
  EXPECT_FALSE(HasPrefix(names[1], "transformer.wpe."));
}

// Greedy decoding of three sequences on paged caches where the third joins
// late: its 5-token prefill chunk runs in one step with the others'
// decodes, so a pipeline step is cut unevenly ({1, 1} and {5} by tokens)
// and prefill and decode chunks share a step. Each step's logits (rows in
// the step's chunk order), every sequence's tokens, and the micro-batches
// this process ran per step.
struct MixedRun {
  std::vector<std::vector<int64_t>> tokens{3};
  std::vector<at::Tensor> logits;
  std::vector<int64_t> micro_batches;
};

MixedRun GreedyMixed(CausalLM& model, dispatch::DispatchedModel* dispatched) {
  c10::InferenceMode inference;
  KvBlockStore store(/*num_blocks=*/24, /*block_size=*/4,
                     static_cast<size_t>(model.config().num_hidden_layers));
  const std::vector<std::vector<int64_t>> prompts = {
      {5, 17, 42, 99, 3, 250, 7}, {300, 1, 2}, {11, 12, 13, 14, 15}};
  std::vector<KvCache> caches(3);
  for (int s = 0; s < 3; ++s) {
    caches[s].store = &store;
    for (int b = 0; b < 8; ++b) caches[s].block_table.push_back(8 * s + b);
  }
  MixedRun out;
  std::vector<int64_t> next = {-1, -1, -1};
  for (int step = 0; step < kNewTokens; ++step) {
    std::vector<int64_t> ids;
    std::vector<SequenceChunk> chunks;
    std::vector<int> order;
    for (int s = 0; s < 3; ++s) {
      if (s == 2 && step < 3) continue;  // joins at step 3
      const bool prefill = next[s] < 0;
      const std::vector<int64_t> in = prefill ? prompts[s] : std::vector<int64_t>{next[s]};
      ids.insert(ids.end(), in.begin(), in.end());
      chunks.push_back({&caches[s], static_cast<int64_t>(in.size())});
      order.push_back(s);
    }
    const int64_t before = PipelineMicroBatchesRun();
    absl::StatusOr<at::Tensor> logits =
        model.Forward(at::tensor(ids, at::kLong), chunks, Logits::kLastOfEach, dispatched);
    EXPECT_THAT(logits, IsOk());
    if (!logits.ok()) return {};
    out.micro_batches.push_back(PipelineMicroBatchesRun() - before);
    out.logits.push_back(*logits);
    const at::Tensor best = logits->argmax(-1);
    for (size_t row = 0; row < order.size(); ++row) {
      const int s = order[row];
      next[s] = best[static_cast<int64_t>(row)].item<int64_t>();
      out.tokens[static_cast<size_t>(s)].push_back(next[s]);
    }
  }
  return out;
}

// Real ranks: size x stages processes; world rank = stage * size + rank.
// Rank 0 drives the others and compares greedy tokens with one process.
TEST(PipelineParallelRank, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of PipelineParallel.*";
  ACCEL_ASSERT_OK_AND_ASSIGN(StagedRank joined, JoinStagedRank());
  dist::ProcessGroup& world = *joined.world;
  const int size = joined.size;
  const int stages = world.size() / size;
  const int world_rank = world.rank();
  EXPECT_EQ(joined.parallel.rank, world_rank % size);
  EXPECT_EQ(joined.parallel.pipeline_rank, world_rank / size);
  EXPECT_EQ(joined.parallel.pipeline_size, stages);
  if (size > 1) {
    ASSERT_NE(joined.stage_group, nullptr);
    EXPECT_EQ(joined.stage_group->rank(), world_rank % size);
    EXPECT_EQ(joined.stage_group->size(), size);
  }
  // ACCEL_TP_CASES: "dir:quantize:micro-batches" entries separated by ','.
  for (absl::string_view item : absl::StrSplit(std::getenv("ACCEL_TP_CASES"), ',')) {
    SCOPED_TRACE(item);
    const std::vector<std::string> fields = absl::StrSplit(item, ':');
    const std::string dir = fields[0];
    ModelLoadOptions load;
    load.device_map = "cpu";
    load.progress = Progress::Style::kSilent;
    load.quantize = fields[1];
    load.tensor_parallel = joined.parallel;
    // 2: one per stage (these steps of a few tokens would run whole under
    // the default, auto), 1: the whole step at once.
    const int micro = std::stoi(fields[2]);
    load.tensor_parallel.pipeline_micro_batches = micro;
    absl::StatusOr<LoadedModel> shard = LoadModel(dir, load);
    ASSERT_THAT(shard, IsOk());
    if (world_rank != 0) {
      EXPECT_THAT(RunTensorParallelWorker(*shard->model, shard->dispatched.get(), world), IsOk());
      continue;
    }
    auto* leader = dynamic_cast<TensorParallelLeader*>(shard->model.get());
    ASSERT_NE(leader, nullptr);
    {
      // Refused on every rank before anything is sent between stages.
      c10::InferenceMode inference;
      EXPECT_THAT(
          leader->Forward(at::tensor({1, 4000}, at::kLong), {{nullptr, 2}}, Logits::kAll, nullptr),
          StatusIs(absl::StatusCode::kInvalidArgument));
      // kAll without caches: every token's logits come back from the last stage.
      absl::StatusOr<at::Tensor> all =
          leader->Forward(at::tensor({1, 2, 3}, at::kLong), {{nullptr, 3}}, Logits::kAll, nullptr);
      ASSERT_THAT(all, IsOk());
      EXPECT_EQ(all->sizes(), (std::vector<int64_t>{3, shard->config.vocab_size}));
    }
    int64_t parallel_store = 0, single_store = 0;
    const int64_t micro_before = PipelineMicroBatchesRun();
    const GreedyRun parallel = Greedy(*leader, nullptr, nullptr, &parallel_store);
    // Two sequences a step: two micro-batches each step (one with micro 1).
    EXPECT_EQ(PipelineMicroBatchesRun() - micro_before, (micro == 1 ? 1 : 2) * kNewTokens);
    const MixedRun parallel_mixed = GreedyMixed(*leader, nullptr);
    EXPECT_TRUE(leader->healthy());
    EXPECT_THAT(leader->Stop(), IsOk());
    LoadedModel whole = Load(dir, 0, 1, fields[1]);
    ASSERT_TRUE(whole.model);
    const GreedyRun single = Greedy(*whole.model, whole.dispatched.get(), nullptr, &single_store);
    const MixedRun single_mixed = GreedyMixed(*whole.model, whole.dispatched.get());
    // Steps of 2 then 3 sequences, micro-batches as the rule cuts them
    // (never more than the stages nor the sequences); one process runs none.
    std::vector<int64_t> want_micro;
    for (int step = 0; step < kNewTokens; ++step) {
      const int chunks = step < 3 ? 2 : 3;
      want_micro.push_back(micro == 1 ? 1 : std::min(chunks, stages));
    }
    EXPECT_EQ(parallel_mixed.micro_batches, want_micro);
    EXPECT_THAT(single_mixed.micro_batches, Each(0));
    ASSERT_EQ(parallel_mixed.logits.size(), single_mixed.logits.size());
    if (shard->dtype == at::kFloat) {
      EXPECT_EQ(parallel_mixed.tokens, single_mixed.tokens);
      for (size_t s = 0; s < single_mixed.logits.size(); ++s) {
        EXPECT_TRUE(at::allclose(parallel_mixed.logits[s], single_mixed.logits[s], 1e-4, 1e-4))
            << "mixed step " << s;
      }
    }
    // float32: the same tokens and logits. 16-bit: stages alone compute what one process does
    // (no partial sums), tensor parallel within them rounds partial sums (ExpectSameGreedy).
    ExpectSameGreedy(parallel, single, /*exact=*/shard->dtype == at::kFloat,
                     shard->config.num_hidden_layers);
    for (size_t s = 0; s < single.logits.size() && shard->dtype == at::kFloat; ++s) {
      EXPECT_TRUE(at::allclose(parallel.logits[s], single.logits[s], 1e-4, 1e-4)) << "step " << s;
    }
    // The leader's KV blocks hold its stage's layers and its heads only.
    const auto [first, last] = PipelineLayers(shard->config.num_hidden_layers, 0, stages);
    EXPECT_EQ(parallel_store * shard->config.num_hidden_layers * size,
              single_store * (last - first));
    const double share = static_cast<double>(ParameterBytes(*shard->model)) /
                         static_cast<double>(ParameterBytes(*whole.model));
    std::printf("%s: rank 0 of %d x %d holds %.1f%% of the weights' bytes\n",
                std::string(item).c_str(), size, stages, 100 * share);
    EXPECT_LT(share, 0.6);
  }
}

// PP 2 and TP 2 x PP 2: float32 greedy tokens equal one process's, for a
// dense family and the two mixture-of-experts families; 4 layers, so that
// the stages hold two each. Each step's sequences run as micro-batches (one
// per stage), and the dense family once more with micro-batching off.
// Llama, Mixtral and Qwen3-MoE in bfloat16 and nf4 (each stage quantizes its
// own layers) too.
TEST(PipelineParallel, StagesDecodeAsOneProcess) {
  TempDir dir;
  std::vector<std::string> cases;
  for (const char* family : {"llama", "mixtral", "qwen3_moe", "gpt2"}) {
    MakeModelOptions o = Small(family);
    o.num_layers = 4;
    o.dtype = at::kFloat;
    const std::string path = absl::StrCat(dir.path(), "/", family);
    ASSERT_THAT(MakeModel(path, o), IsOk());
    cases.push_back(absl::StrCat(path, ":none:2"));
    // Micro-batching off: the whole step at once, the same tokens.
    if (std::string(family) == "llama") cases.push_back(absl::StrCat(path, ":none:1"));
  }
  for (const char* family : {"llama", "mixtral", "qwen3_moe"}) {
    MakeModelOptions o = Small(family);
    o.num_layers = 4;
    o.dtype = at::kBFloat16;
    const std::string bf16 = absl::StrCat(dir.path(), "/", family, "-bfloat16");
    ASSERT_THAT(MakeModel(bf16, o), IsOk());
    cases.push_back(absl::StrCat(bf16, ":none:2"));
    cases.push_back(absl::StrCat(bf16, ":nf4:2"));
  }
  for (int size : {1, 2}) {
    SCOPED_TRACE(size);
    EXPECT_THAT(test::RunRanks(2 * size, "PipelineParallelRank.Run",
                               {{"ACCEL_TP_CASES", absl::StrJoin(cases, ",")},
                                {"ACCEL_TP_SIZE", std::to_string(size)}},
                               /*timeout_s=*/120),
                Each(0));
  }
}

// A rank of PipelineParallel.AWorkerRefusesAStepMessageOverOneGiB: rank 0
// sends a step message's size of 2 GiB where the leader would send a step;
// rank 1, the second stage of the model in ACCEL_TP_CASES, refuses it before
// allocating anything and leaves as for a leader gone.
TEST(CorruptMessageRank, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of PipelineParallel.AWorkerRefuses*";
  ACCEL_ASSERT_OK_AND_ASSIGN(StagedRank joined, JoinStagedRank());
  dist::ProcessGroup& world = *joined.world;
  if (world.rank() == 0) {
    EXPECT_THAT(world.Send(at::full({1}, int64_t{1} << 31, at::kLong), 1), IsOk());
    return;
  }
  ModelLoadOptions load;
  load.device_map = "cpu";
  load.progress = Progress::Style::kSilent;
  load.tensor_parallel = joined.parallel;
  absl::StatusOr<LoadedModel> shard = LoadModel(std::getenv("ACCEL_TP_CASES"), load);
  ASSERT_THAT(shard, IsOk());
  ASSERT_EQ(shard->model->pipeline_size(), 2);
  EXPECT_THAT(RunTensorParallelWorker(*shard->model, shard->dispatched.get(), world),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("a message of 2147483648 bytes")));
}

TEST(PipelineParallel, AWorkerRefusesAStepMessageOverOneGiB) {
  TempDir dir;
  MakeModelOptions o = Small("llama");
  o.num_layers = 2;
  const std::string path = absl::StrCat(dir.path(), "/llama");
  ASSERT_THAT(MakeModel(path, o), IsOk());
  EXPECT_THAT(test::RunRanks(2, "CorruptMessageRank.Run",
                             {{"ACCEL_TP_CASES", path}, {"ACCEL_TP_SIZE", "1"}},
                             /*timeout_s=*/60),
              Each(0));
}

// ---------------------------------------------------------------------------
// LongRoPE on split ranks: a sequence whose step crosses the original
// context is recomputed whole with the long factors on every rank (its ids
// go with that step), so that the tokens and logits are one process's.

constexpr int kLongTokens = 10;

struct LongRun {
  std::vector<std::vector<int64_t>> tokens{2};
  std::vector<at::Tensor> logits;
  std::vector<int64_t> lengths;  // the caches' lengths at the end
  bool paged = false;            // both caches still in the store at the end
};

// Greedy decoding of prompts of 60 and 57 tokens on paged caches, past a
// LongRoPE model's original context of 64: the first sequence crosses it
// at step 5, the second at step 8. Even steps go through Submit (the
// pipeline's path), odd ones through Forward.
LongRun GreedyLong(CausalLM& model, dispatch::DispatchedModel* dispatched) {
  c10::InferenceMode inference;
  KvBlockStore store(/*num_blocks=*/48, /*block_size=*/4,
                     static_cast<size_t>(model.config().num_hidden_layers));
  std::vector<KvCache> caches(2);
  std::vector<int64_t> ids;
  for (int s = 0; s < 2; ++s) {
    caches[s].store = &store;
    for (int b = 0; b < 24; ++b) caches[s].block_table.push_back(24 * s + b);
  }
  for (int i = 0; i < 60; ++i) ids.push_back((37 * i + 5) % 300);
  for (int i = 0; i < 57; ++i) ids.push_back((53 * i + 11) % 300);
  std::vector<SequenceChunk> chunks = {{&caches[0], 60}, {&caches[1], 57}};
  LongRun out;
  for (int step = 0; step < kLongTokens; ++step) {
    const at::Tensor input = at::tensor(ids, at::kLong);
    absl::StatusOr<at::Tensor> logits;
    if (step % 2 == 0) {
      absl::StatusOr<std::unique_ptr<PendingLogits>> pending =
          model.Submit(input, chunks, Logits::kLastOfEach, dispatched);
      EXPECT_THAT(pending, IsOk());
      if (!pending.ok()) return {};
      logits = (*pending)->Wait();
    } else {
      logits = model.Forward(input, chunks, Logits::kLastOfEach, dispatched);
    }
    EXPECT_THAT(logits, IsOk()) << "step " << step;
    if (!logits.ok()) return {};
    out.logits.push_back(*logits);
    const at::Tensor next = logits->argmax(-1);
    ids = {next[0].item<int64_t>(), next[1].item<int64_t>()};
    out.tokens[0].push_back(ids[0]);
    out.tokens[1].push_back(ids[1]);
    chunks = {{&caches[0], 1}, {&caches[1], 1}};
  }
  out.lengths = {caches[0].length, caches[1].length};
  out.paged = caches[0].paged() && caches[1].paged();
  return out;
}

// A rank of a size x stages group (ACCEL_TP_SIZE ranks a stage) serving the
// model in ACCEL_TP_CASES; rank 0 compares with one process.
TEST(LongRopeRank, Run) {
  if (!test::IsWorker()) GTEST_SKIP() << "a rank of LongRope.*";
  ACCEL_ASSERT_OK_AND_ASSIGN(StagedRank joined, JoinStagedRank());
  dist::ProcessGroup& world = *joined.world;
  const std::string dir = std::getenv("ACCEL_TP_CASES");
  ModelLoadOptions load;
  load.device_map = "cpu";
  load.progress = Progress::Style::kSilent;
  load.tensor_parallel = joined.parallel;
  load.tensor_parallel.pipeline_micro_batches = 2;  // the two sequences as two micro-batches
  absl::StatusOr<LoadedModel> shard = LoadModel(dir, load);
  ASSERT_THAT(shard, IsOk());
  if (world.rank() != 0) {
    EXPECT_THAT(RunTensorParallelWorker(*shard->model, shard->dispatched.get(), world), IsOk());
    return;
  }
  auto* leader = dynamic_cast<TensorParallelLeader*>(shard->model.get());
  ASSERT_NE(leader, nullptr);
  EXPECT_EQ(leader->recompute_after(), 64);
  const LongRun split = GreedyLong(*leader, nullptr);
  EXPECT_TRUE(leader->healthy());
  EXPECT_THAT(leader->Stop(), IsOk());
  LoadedModel whole = Load(dir, 0, 1);
  ASSERT_TRUE(whole.model);
  const LongRun single = GreedyLong(*whole.model, whole.dispatched.get());
  ASSERT_EQ(split.logits.size(), static_cast<size_t>(kLongTokens));
  ASSERT_EQ(single.logits.size(), static_cast<size_t>(kLongTokens));
  // Both sequences crossed: one process holds them in recomputed
  // (contiguous) caches, the split ranks in their own blocks, rewritten.
  EXPECT_EQ(single.lengths, (std::vector<int64_t>{60 + kLongTokens - 1, 57 + kLongTokens - 1}));
  EXPECT_EQ(split.lengths, single.lengths);
  EXPECT_FALSE(single.paged);
  EXPECT_TRUE(split.paged);
  EXPECT_EQ(split.tokens, single.tokens);
  for (size_t s = 0; s < single.logits.size(); ++s) {
    EXPECT_TRUE(at::allclose(split.logits[s], single.logits[s], 1e-4, 1e-4)) << "step " << s;
  }
}

// A Phi-3 LongRoPE model (original context 64 of 256) with TP 2, PP 2 and
// TP 2 x PP 2 in float32: the tokens and logits of one process, with both
// sequences crossing the original context mid-generation.
TEST(LongRope, SplitRanksRecomputeAsOneProcess) {
  TempDir dir;
  MakeModelOptions o = Small("phi3");
  o.longrope_factor = 4;
  o.dtype = at::kFloat;
  ASSERT_THAT(MakeModel(dir.path(), o), IsOk());
  for (const auto& [ranks, size] : std::vector<std::pair<int, int>>{{2, 2}, {2, 1}, {4, 2}}) {
    SCOPED_TRACE(absl::StrCat(ranks, " ranks, ", size, " a stage"));
    EXPECT_THAT(
        test::RunRanks(ranks, "LongRopeRank.Run",
                       {{"ACCEL_TP_CASES", dir.path()}, {"ACCEL_TP_SIZE", std::to_string(size)}},
                       /*timeout_s=*/120),
        Each(0));
  }
}

}  // namespace
}  // namespace accel::models
