// The command-line tools as a user runs them: accel-make-model, then
// accel-inspect on its output, checking stdout, stderr and exit codes.
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <re2/re2.h>

#include "tests/testing/command.h"
#include "tests/testing/multiprocess.h"
#include "tests/testing/temp_dir.h"

namespace accel {
namespace {

using ::accel::test::TempDir;
using ::testing::HasSubstr;

using Result = test::CommandResult;  // out: stdout and stderr together

// `env`: VAR=value assignments for the command, or empty.
Result RunTool(const std::string& command, const std::string& env = "") {
  const char* bin = std::getenv("ACCEL_BIN_DIR");
  return test::CommandOutput((env.empty() ? "" : env + " ") + std::string(bin ? bin : "build/bin") +
                             "/" + command + " 2>&1");
}

// stdout alone (stderr dropped): for output that must parse.
Result RunToolStdout(const std::string& command, const std::string& env = "") {
  return RunTool(command + " 2>/dev/null #", env);  // the '#' comments out RunTool's own 2>&1
}

TEST(ToolsTest, InspectJsonDescribesWhatMakeModelWrote) {
  TempDir dir;
  Result made = RunTool("accel-make-model " + dir.path() +
                        "/m --family qwen2 --num_layers 3 "
                        "--dtype bfloat16 --max_shard_size 40KB");
  ASSERT_EQ(made.exit_code, 0) << made.out;
  EXPECT_THAT(made.out, HasSubstr("Qwen2ForCausalLM, 3 layers"));

  Result inspect = RunTool("accel-inspect --json " + dir.path() + "/m");
  ASSERT_EQ(inspect.exit_code, 0) << inspect.out;
  nlohmann::json j = nlohmann::json::parse(inspect.out);
  uint64_t sum = 0;
  std::set<std::string> files;
  for (const auto& t : j["tensors"]) {
    EXPECT_EQ(t["dtype"], "BF16");
    uint64_t numel = 1;
    for (const auto& d : t["shape"]) numel *= d.get<uint64_t>();
    EXPECT_EQ(t["bytes"].get<uint64_t>(), numel * 2);
    sum += t["bytes"].get<uint64_t>();
    files.insert(t["file"].get<std::string>());
  }
  EXPECT_EQ(j["total_bytes"].get<uint64_t>(), sum);
  EXPECT_GT(files.size(), 1u);
  EXPECT_EQ(j["metadata"]["format"], "pt");
  EXPECT_EQ(j["metadata"]["total_size"], std::to_string(sum));
  EXPECT_EQ(j["tensors"].size(), 1 + 3 * 12 + 2u);  // qwen2: q/k/v biases
}

TEST(ToolsTest, InspectTablePrintsTotalsAndMetadata) {
  TempDir dir;
  ASSERT_EQ(RunTool("accel-make-model " + dir.path() + " --family gpt2").exit_code, 0);
  Result r = RunTool("accel-inspect " + dir.path() + "/model.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("transformer.h.1.mlp.c_fc.weight"));
  EXPECT_THAT(r.out, HasSubstr("totals by dtype"));
  EXPECT_THAT(r.out, HasSubstr("format: pt"));
}

TEST(ToolsTest, InspectBadInputIsAMessageAndExitOne) {
  TempDir dir;
  Result missing = RunTool("accel-inspect " + dir.path() + "/nope.safetensors");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.out, HasSubstr("nope.safetensors"));
  std::string garbage =
      dir.Write("bad.safetensors", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{}", 10));
  Result bad = RunTool("accel-inspect " + garbage);
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.out, HasSubstr("exceeds the limit"));
  Result no_args = RunTool("accel-inspect");
  EXPECT_EQ(no_args.exit_code, 1);
  EXPECT_THAT(no_args.out, HasSubstr("PATH"));
}

TEST(ToolsTest, MakeModelBadFlagsAreAMessageAndExitOne) {
  TempDir dir;
  Result r = RunTool("accel-make-model " + dir.path() + " --dtype float31");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("--dtype"));
  r = RunTool("accel-make-model " + dir.path() + " --size 10G");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("--size"));
}

TEST(ToolsTest, DeviceMapPlansAGeneratedModelWithoutItsWeights) {
  TempDir dir;
  // 4 layers of hidden 128, float32: embed and head 256 KiB each, a layer about 709 KiB.
  ASSERT_EQ(
      RunTool("accel-make-model " + dir.path() + " --num_layers 4 --hidden_size 128").exit_code, 0);
  std::remove((dir.path() + "/model.safetensors").c_str());  // planning never reads weights
  Result r = RunTool("accel-device-map --model " + dir.path() +
                     " --max_memory 0=2MB,1=2MB,cpu=10MB --strategy sequential");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json map = nlohmann::json::parse(r.out);
  // GPU 0 keeps a layer's worth in reserve: embed + 1 layer; GPU 1 (no reserve): 2 layers;
  // the rest goes to the cpu.
  EXPECT_EQ(map["model.embed_tokens"], 0);
  EXPECT_EQ(map["model.layers.0"], 0);
  EXPECT_EQ(map["model.layers.1"], 1);
  EXPECT_EQ(map["model.layers.2"], 1);
  EXPECT_EQ(map["model.layers.3"], "cpu");
  EXPECT_EQ(map["lm_head"], "cpu");

  Result half =
      RunTool("accel-device-map --model " + dir.path() + " --max_memory 0=4MB --dtype float16");
  ASSERT_EQ(half.exit_code, 0) << half.out;
  EXPECT_EQ(nlohmann::json::parse(half.out), nlohmann::json::parse(R"({"": 0})"));
}

// A Mixtral's experts placed one by one: dense parts in RAM, experts past
// the room left (beside the cache) on disk; without the flag, whole layers.
TEST(ToolsTest, DeviceMapPlacesExpertsOneByOneWithOffloadExperts) {
  TempDir dir;
  ASSERT_EQ(RunTool("accel-make-model " + dir.path() +
                    " --family mixtral --num_layers 2 --hidden_size 64 --num_experts 8")
                .exit_code,
            0);
  std::remove((dir.path() + "/model.safetensors").c_str());  // planning never reads weights
  Result r = RunToolStdout("accel-device-map --model " + dir.path() +
                           " --max_memory cpu=1MiB,disk=1GiB --offload_experts=true --verbose");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json map = nlohmann::json::parse(r.out);
  EXPECT_EQ(map["model.layers.1.self_attn"], "cpu");
  EXPECT_EQ(map["model.layers.1.block_sparse_moe.gate"], "cpu");
  EXPECT_EQ(map["lm_head"], "cpu");
  EXPECT_EQ(map["model.layers.1.block_sparse_moe.experts"], "disk");
  EXPECT_FALSE(map.contains("model.layers.1"));
  Result verbose = RunTool("accel-device-map --model " + dir.path() +
                           " --max_memory cpu=1MiB,disk=1GiB --offload_experts=true --verbose");
  EXPECT_THAT(verbose.out, HasSubstr("expert cache: 512 KiB"));

  // Without it, Accelerate's plan: no key inside a MixtralDecoderLayer, never split.
  Result whole = RunToolStdout("accel-device-map --model " + dir.path() +
                               " --max_memory cpu=1MiB,disk=1GiB --strategy sequential");
  ASSERT_EQ(whole.exit_code, 0) << whole.out;
  EXPECT_THAT(whole.out, ::testing::Not(HasSubstr("experts")));
  EXPECT_THAT(whole.out, ::testing::Not(HasSubstr("self_attn")));

  Result dense = RunTool("accel-make-model " + dir.path() + "/llama --num_layers 1");
  ASSERT_EQ(dense.exit_code, 0);
  Result refused = RunTool("accel-device-map --model " + dir.path() +
                           "/llama --max_memory cpu=1MiB --offload_experts=true");
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_THAT(refused.out, HasSubstr("no mixture-of-experts layers"));
}

TEST(ToolsTest, DeviceMapReadsATreeAndExplainsBadInput) {
  TempDir dir;
  std::string tree = dir.Write("tree.json", R"({"class": "M", "children": [
    {"name": "a", "class": "Linear", "params": [{"name": "weight", "shape": [100, 100]}]},
    {"name": "b", "class": "Linear", "params": [{"name": "weight", "shape": [100, 100]}]}]})");
  Result r = RunTool("accel-device-map --tree " + tree +
                     " --max_memory 0=50000,cpu=1GB --strategy sequential --verbose");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out,
              HasSubstr(R"({"":"cpu"})"));  // 0 has room for a, but not with the reserve for b
  EXPECT_THAT(r.out, HasSubstr("nothing could be placed on 0"));

  EXPECT_EQ(RunTool("accel-device-map").exit_code, 1);
  Result bad_tree =
      RunTool("accel-device-map --tree " + dir.Write("bad.json", "{\"children\": 3}"));
  EXPECT_EQ(bad_tree.exit_code, 1);
  EXPECT_THAT(bad_tree.out, HasSubstr("bad.json"));
  Result bad_strategy =
      RunTool("accel-device-map --tree " + tree + " --max_memory cpu=1GB --strategy fast");
  EXPECT_EQ(bad_strategy.exit_code, 1);
  EXPECT_THAT(bad_strategy.out, HasSubstr("'fast'"));
  Result bad_memory = RunTool("accel-device-map --tree " + tree + " --max_memory gpu=1GB");
  EXPECT_EQ(bad_memory.exit_code, 1);
  EXPECT_THAT(bad_memory.out, HasSubstr("--max_memory"));
}

TEST(ToolsTest, EstimateMemoryMatchesAccelerateArithmetic) {
  TempDir dir;
  ASSERT_EQ(RunTool("accel-make-model " + dir.path() +
                    " --num_layers 2 --hidden_size 64 --vocab_size 512")
                .exit_code,
            0);
  Result r = RunTool("accel-estimate-memory --json --model " + dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json rows = nlohmann::json::parse(r.out);
  ASSERT_EQ(rows.size(), 8u);
  // float32: 2 x (512 x 64) embedding/head + 2 layers of (4 x 64 x 64 + 3 x 64 x 176 + 2 x 64)
  // + the final norm (64) + the rotary inv_freq buffer (head_dim / 2 = 8; Accelerate counts
  // buffers).
  const double layer = 4.0 * (4 * 64 * 64 + 3 * 64 * 176 + 2 * 64);
  const double total = 4.0 * (2 * 512 * 64 + 64 + 8) + 2 * layer;
  EXPECT_EQ(rows[0]["dtype"], "float32");
  EXPECT_EQ(rows[0]["total_bytes"].get<double>(), total);
  EXPECT_EQ(rows[0]["largest_layer_bytes"].get<double>(),
            layer);  // a decoder layer beats the embedding
  EXPECT_EQ(rows[0]["training_adam_peak_bytes"].get<double>(), 4 * total);
  EXPECT_EQ(rows[1]["total_bytes"].get<double>(), total / 2);
  EXPECT_EQ(rows[1]["training_adam_peak_bytes"].get<double>(), 2 * total);
  EXPECT_EQ(rows[3]["total_bytes"].get<double>(), total / 8);
  EXPECT_TRUE(rows[3]["training_adam_peak_bytes"].is_null());
  // bitsandbytes as stored: the 7 linears of each layer quantized, the rest in 16 bits.
  const double linear_params = 4 * 64 * 64 + 3 * 64 * 176;
  const double linear_outputs = 4 * 64 + 2 * 176 + 64;  // rows: one SCB each
  const double rest16 = 2.0 * (2 * 512 * 64 + 64 + 8 + 2 * 2 * 64);
  EXPECT_EQ(rows[4]["dtype"], "bnb int8");
  EXPECT_EQ(rows[4]["total_bytes"].get<double>(),
            rest16 + 2 * (linear_params + 4 * linear_outputs + 7 /* weight_format */));
  // 4-bit: half a byte a weight, a float32 absmax per 64, a 16-value map per linear.
  const double blocks = 2 * (4 * 64 + 3 * 176);  // per layer: 64x64 -> 64 blocks, 64x176 -> 176
  EXPECT_EQ(rows[5]["total_bytes"].get<double>(),
            rest16 + 2 * (linear_params / 2 + 7 * 16 * 4) + 4 * blocks);
  // Double quant: uint8 absmaxes, a float32 per 256 of them, a 256-value map per linear, and
  // the float32 expanded absmaxes kept for compute.
  EXPECT_LT(rows[6]["total_bytes"].get<double>(), rows[4]["total_bytes"].get<double>());
  // Then the plan a load with no flags makes here: the float32 model fits, all of it in
  // memory, the same total as Accelerate's, beside the runtime's reserve and a KV cache of
  // what the cpu budget leaves beside the weights.
  const nlohmann::json& plan = rows[7]["memory_plan"];
  EXPECT_EQ(plan["dtype"], "Float");
  EXPECT_TRUE(plan["fits"].get<bool>());
  EXPECT_EQ(plan["disk_weight_bytes"].get<double>(), 0);
  EXPECT_EQ(plan["resident_weight_bytes"].get<double>(), total);
  EXPECT_GT(plan["runtime_bytes"].get<double>(), 0);
  EXPECT_EQ(plan["kv_cache_bytes"].get<double>(),
            std::max(plan["budget_bytes"].get<double>() - total, 256.0 * (1 << 20)));
  EXPECT_EQ(plan["resident_bytes"].get<double>(), plan["resident_weight_bytes"].get<double>() +
                                                      plan["kv_cache_bytes"].get<double>() +
                                                      plan["runtime_bytes"].get<double>());
  Result table = RunTool("accel-estimate-memory --model " + dir.path());
  EXPECT_THAT(table.out, HasSubstr("float16/bfloat16"));
  EXPECT_THAT(table.out, HasSubstr("Loaded with no load flags here (Float"));
  Result missing = RunTool("accel-estimate-memory --model " + dir.path() + "/nope");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.out, HasSubstr("config.json"));
}

TEST(ToolsTest, EstimateMemoryPerTensorParallelRank) {
  TempDir dir;
  ASSERT_EQ(RunTool("accel-make-model " + dir.path() +
                    " --num_layers 2 --hidden_size 64 --vocab_size 512")
                .exit_code,
            0);
  Result r = RunTool("accel-estimate-memory --json --tensor_parallel_size 2 --model " + dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json rows = nlohmann::json::parse(r.out);
  ASSERT_EQ(rows.size(), 8u);
  // One rank: half of every linear (4 heads -> 2, 176 -> 88) and of the vocab rows; norms
  // and the rotary buffer whole.
  const double layer = 4.0 * (4 * 64 * 32 + 3 * 64 * 88 + 2 * 64);
  EXPECT_EQ(rows[0]["total_bytes"].get<double>(), 4.0 * (2 * 256 * 64 + 64 + 8) + 2 * layer);
  const nlohmann::json& parallel = rows[7];
  EXPECT_EQ(parallel["tensor_parallel_size"], 2);
  // 2 layers x keys and values x 2 of 4 KV heads x 16 x 1024 tokens x 4 bytes.
  EXPECT_EQ(parallel["float32"]["kv_cache_bytes_per_1k_tokens_per_rank"].get<double>(),
            2.0 * 2 * 2 * 16 * 1024 * 4);
  // Per token: 1 + 2 x 2 all-reduces of 64 floats, and a slice of 256 logits gathered.
  EXPECT_EQ(parallel["float32"]["all_reduces_per_token"], 5);
  EXPECT_EQ(parallel["float32"]["collective_payload_bytes_per_token_per_rank"].get<double>(),
            5 * 64 * 4 + 256 * 4);
  EXPECT_EQ(parallel["float16/bfloat16"]["ring_wire_bytes_per_token_per_rank"].get<double>(),
            5 * 64 * 2 + 256 * 2);
  Result uneven = RunTool("accel-estimate-memory --tensor_parallel_size 3 --model " + dir.path());
  EXPECT_EQ(uneven.exit_code, 1);
  EXPECT_THAT(uneven.out, HasSubstr("num_attention_heads (4)"));

  // TP 2 x PP 2: the largest stage is the last (layer 1, the norm, its half of lm_head; the
  // first holds layer 0 and its half of the embedding).
  Result staged = RunTool(
      "accel-estimate-memory --json --tensor_parallel_size 2 "
      "--pipeline_parallel_size 2 --model " +
      dir.path());
  ASSERT_EQ(staged.exit_code, 0) << staged.out;
  rows = nlohmann::json::parse(staged.out);
  ASSERT_EQ(rows.size(), 8u);
  EXPECT_EQ(rows[0]["total_bytes"].get<double>(), 4.0 * (256 * 64 + 64 + 8) + layer);
  const nlohmann::json& both = rows[7];
  EXPECT_EQ(both["pipeline_parallel_size"], 2);
  // 1 layer x keys and values x 2 of 4 KV heads x 16 x 1024 tokens x 4 bytes.
  EXPECT_EQ(both["float32"]["kv_cache_bytes_per_1k_tokens_per_rank"].get<double>(),
            1.0 * 2 * 2 * 16 * 1024 * 4);
  // The first stage's ranks: 1 + 2 x 1 all-reduces, no gather (the last stage's); a token's
  // hidden state to the next stage, a sampled token's float32 logits to the leader.
  EXPECT_EQ(both["float32"]["all_reduces_per_token"], 3);
  EXPECT_EQ(both["float32"]["collective_payload_bytes_per_token_per_rank"].get<double>(),
            3 * 64 * 4);
  EXPECT_EQ(both["float16/bfloat16"]["stage_send_bytes_per_token_per_rank"].get<double>(), 64 * 2);
  EXPECT_EQ(both["float32"]["logits_bytes_per_sampled_token"].get<double>(), 512 * 4);
  Result deep = RunTool("accel-estimate-memory --pipeline_parallel_size 3 --model " + dir.path());
  EXPECT_EQ(deep.exit_code, 1);
  EXPECT_THAT(deep.out, HasSubstr("num_hidden_layers (2)"));
}

// ---- accel-quantize ----------------------------------------------------------

TEST(ToolsTest, QuantizeWritesAModelThatGeneratesAsQuantizingOnLoad) {
  TempDir dir;
  const std::string model = dir.path() + "/m", out = dir.path() + "/m-nf4";
  ASSERT_EQ(RunTool("accel-make-model " + model + " --num_layers 2 --hidden_size 64").exit_code, 0);
  Result r =
      RunTool("accel-quantize --model " + model + " --out " + out + " --method nf4 --double_quant");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("14 layers quantized (nf4+dq)"));
  const std::string generate = " --prompt 'Once upon' --max_new_tokens 6 --temperature 0 --json";
  Result from_saved = RunToolStdout("accel-generate --model " + out + generate);
  Result on_load = RunToolStdout("accel-generate --model " + model + generate +
                                 " --quantize nf4 --double_quant");
  ASSERT_EQ(from_saved.exit_code, 0) << from_saved.out;
  EXPECT_EQ(nlohmann::json::parse(from_saved.out)["token_ids"],
            nlohmann::json::parse(on_load.out)["token_ids"]);
  // The saved model is sized as stored: it needs fewer disk modules than the float one.
  Result plan_saved =
      RunTool("accel-device-map --model " + out + " --max_memory cpu=400KiB,disk=1GiB");
  Result plan_asked = RunTool("accel-device-map --model " + model +
                              " --quantize nf4 --double_quant --max_memory cpu=400KiB,disk=1GiB");
  Result plan_float =
      RunTool("accel-device-map --model " + model + " --max_memory cpu=400KiB,disk=1GiB");
  ASSERT_EQ(plan_saved.exit_code, 0) << plan_saved.out;
  EXPECT_EQ(plan_saved.out, plan_asked.out);
  EXPECT_NE(plan_saved.out, plan_float.out);

  Result again =
      RunTool("accel-quantize --model " + out + " --out " + dir.path() + "/x --method int8");
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_THAT(again.out, HasSubstr("quantized already"));
  Result bad =
      RunTool("accel-quantize --model " + model + " --out " + dir.path() + "/y --method q4");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.out, HasSubstr("--method 'q4'"));
  Result bad_map =
      RunTool("accel-device-map --model " + model + " --quantize q4 --max_memory cpu=1GiB");
  EXPECT_EQ(bad_map.exit_code, 1);
  EXPECT_THAT(bad_map.out, HasSubstr("quantize 'q4'"));
  Result saved_as_int8 =
      RunTool("accel-device-map --model " + out + " --quantize int8 --max_memory cpu=1GiB");
  EXPECT_EQ(saved_as_int8.exit_code, 1);
  EXPECT_THAT(saved_as_int8.out, HasSubstr("quantized already"));
  Result no_out = RunTool("accel-quantize --model " + model + " --method int8");
  EXPECT_EQ(no_out.exit_code, 1);
  EXPECT_THAT(no_out.out, HasSubstr("--out"));
  Result block = RunTool("accel-quantize --model " + model + " --out " + dir.path() +
                         "/z --method fp4 --blocksize 100");
  EXPECT_EQ(block.exit_code, 1);
  EXPECT_THAT(block.out, HasSubstr("blocksize 100"));
}

// ---- accel-generate ----------------------------------------------------------

class GenerateToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = dir_.path() + "/m";
    Result made = RunTool("accel-make-model " + model_ + " --family llama --num_layers 3");
    ASSERT_EQ(made.exit_code, 0) << made.out;
  }
  nlohmann::json Json(const std::string& flags) {
    Result r = RunToolStdout("accel-generate --model " + model_ + " --json " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.out;
    auto parsed = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(parsed.is_discarded()) << r.out;
    return parsed;
  }
  TempDir dir_;
  std::string model_;
};

TEST_F(GenerateToolTest, JsonFromInputIdsIsOneLineAndReproducible) {
  nlohmann::json greedy =
      Json("--input_ids 1,2,3 --max_new_tokens 6 --ignore_eos --device_map cpu");
  ASSERT_TRUE(greedy.is_object());
  EXPECT_EQ(greedy["token_ids"].size(), 6u);
  EXPECT_EQ(greedy["finish_reason"], "length");
  EXPECT_TRUE(greedy["text"].is_string());
  EXPECT_FALSE(greedy.contains("logprobs"));
  EXPECT_EQ(Json("--input_ids 1,2,3 --max_new_tokens 6 --ignore_eos"), greedy);  // auto map
  const std::string sampled =
      "--input_ids 1,2,3 --max_new_tokens 8 --ignore_eos --temperature 1.5 ";
  nlohmann::json a = Json(sampled + "--seed 11 --logprobs");
  EXPECT_EQ(a, Json(sampled + "--seed 11 --logprobs"));
  EXPECT_NE(a["token_ids"], Json(sampled + "--seed 12")["token_ids"]);
  ASSERT_EQ(a["logprobs"].size(), 8u);
  for (const auto& lp : a["logprobs"]) EXPECT_LT(lp.get<double>(), 0.0);
}

// --tensor_parallel_size / --pipeline_parallel_size on one machine: this
// process is rank 0 and starts the others (the same binary and flags); the
// greedy tokens are one process's (float32), with 3 stages, 2 x 2 ranks,
// micro-batching off, and speculative decoding over TP 2 and PP 2; what
// cannot split is refused by name before a rank starts.
TEST_F(GenerateToolTest, SplitOverRanksGeneratesAsOneProcess) {
  const std::string flags =
      "--input_ids 1,2,3,4,5 --max_new_tokens 8 --ignore_eos --parallel_timeout 30s ";
  const nlohmann::json one = Json(flags);
  ASSERT_TRUE(one.is_object());
  for (const std::string split :
       {"--pipeline_parallel_size 3", "--tensor_parallel_size 2 --pipeline_parallel_size 2",
        "--pipeline_parallel_size 2 --pipeline_micro_batches 1"}) {
    SCOPED_TRACE(split);
    const nlohmann::json parallel =
        Json(flags + split + " --master_port " + std::to_string(test::FreePort()));
    ASSERT_TRUE(parallel.is_object());
    EXPECT_EQ(parallel["token_ids"], one["token_ids"]);
  }
  // Speculative decoding (prompt lookup, drafting from the repeated ids) on
  // split models: every rank verifies the same 1 + k rows a chunk (the step
  // message carries them), so the greedy tokens are one process's without
  // drafts, and drafts were accepted.
  const std::string repeated =
      "--input_ids 5,9,7,5,9,7,5,9,7,5 --max_new_tokens 12 --ignore_eos --parallel_timeout 30s ";
  const nlohmann::json plain = Json(repeated);
  ASSERT_TRUE(plain.is_object());
  for (const std::string split : {"--tensor_parallel_size 2", "--pipeline_parallel_size 2"}) {
    SCOPED_TRACE(split);
    const std::string log = dir_.path() + "/speculative.log";
    const nlohmann::json drafted =
        Json(repeated + split + " --master_port " + std::to_string(test::FreePort()) +
             R"( --speculative_config '{"method": "ngram", "num_speculative_tokens": 3}' 2>)" +
             log + " #");
    ASSERT_TRUE(drafted.is_object());
    EXPECT_EQ(drafted["token_ids"], plain["token_ids"]);
    std::ifstream in(log);
    const std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    int64_t accepted = 0;
    EXPECT_TRUE(RE2::PartialMatch(err, R"(drafted tokens, (\d+) accepted)", &accepted)) << err;
    EXPECT_GT(accepted, 0) << err;
  }
  Result stages =
      RunTool("accel-generate --model " + model_ + " --input_ids 1,2 --pipeline_parallel_size 4");
  EXPECT_EQ(stages.exit_code, 1);
  EXPECT_THAT(stages.out, HasSubstr("pipeline_parallel_size 4: more stages than config.json's "
                                    "num_hidden_layers (3)"));
  Result micro = RunTool("accel-generate --model " + model_ +
                         " --input_ids 1,2 --pipeline_parallel_size 2 --pipeline_micro_batches -1");
  EXPECT_EQ(micro.exit_code, 1);
  EXPECT_THAT(micro.out, HasSubstr("--pipeline_micro_batches must be 0 or more"));
}

// GPT-2 (Conv1D layers, learned positions, a tied head) and a Phi-3
// LongRoPE model split over ranks by accel-generate's engine: the greedy
// tokens are one process's. The LongRoPE prompt of 60 ids reaches the
// original context (64) after 4 tokens, so a decode step recomputes the
// sequence on every rank.
TEST_F(GenerateToolTest, Gpt2AndLongRopeSplitOverRanksGenerateAsOneProcess) {
  std::string long_prompt;
  for (int i = 0; i < 60; ++i) {
    long_prompt += (i == 0 ? "" : ",") + std::to_string((37 * i + 5) % 500);
  }
  for (const std::string family : {"gpt2 --num_layers 2", "phi3 --longrope_factor 4"}) {
    SCOPED_TRACE(family);
    model_ = dir_.path() + "/" + family.substr(0, 4);
    Result made = RunTool("accel-make-model " + model_ + " --family " + family);
    ASSERT_EQ(made.exit_code, 0) << made.out;
    const std::string flags =
        "--input_ids " + long_prompt + " --max_new_tokens 10 --ignore_eos --parallel_timeout 30s ";
    const nlohmann::json one = Json(flags);
    ASSERT_TRUE(one.is_object());
    ASSERT_EQ(one["token_ids"].size(), 10u);
    for (const std::string split : {"--tensor_parallel_size 2", "--pipeline_parallel_size 2",
                                    "--tensor_parallel_size 2 --pipeline_parallel_size 2"}) {
      SCOPED_TRACE(split);
      const nlohmann::json parallel =
          Json(flags + split + " --master_port " + std::to_string(test::FreePort()));
      ASSERT_TRUE(parallel.is_object());
      EXPECT_EQ(parallel["token_ids"], one["token_ids"]);
    }
  }
}

// --regex / --json_schema / --grammar: the random model's text follows them.
TEST_F(GenerateToolTest, StructuredOutputFlags) {
  const std::string sampled = "--prompt hi --max_new_tokens 200 --temperature 1 --seed 3 ";
  nlohmann::json regex = Json(sampled + "--regex '[0-9]{3}-[a-c]{2}'");
  ASSERT_TRUE(regex.is_object());
  EXPECT_EQ(regex["finish_reason"], "eos");
  EXPECT_TRUE(RE2::FullMatch(regex["text"].get<std::string>(), "[0-9]{3}-[a-c]{2}")) << regex;
  const std::string schema = dir_.path() + "/schema.json";
  std::ofstream(schema) << R"({"type": "object", "properties": {"ok": {"type": "boolean"},
      "n": {"enum": [1, 2, 3]}}, "required": ["ok", "n"]})";
  nlohmann::json json = Json(sampled + "--json_schema " + schema);
  ASSERT_TRUE(json.is_object());
  const auto value = nlohmann::json::parse(json["text"].get<std::string>(), nullptr, false);
  ASSERT_TRUE(value.is_object()) << json;
  EXPECT_TRUE(value["ok"].is_boolean());
  EXPECT_TRUE(value["n"].is_number_integer());
  Result two = RunTool("accel-generate --model " + model_ + " --prompt hi --regex a --grammar g");
  EXPECT_NE(two.exit_code, 0);
  EXPECT_THAT(two.out, HasSubstr("at most one of --json_schema, --regex and --grammar"));
  const std::string bad = dir_.path() + "/bad.json";
  std::ofstream(bad) << R"({"type": "string", "format": "hostname"})";
  Result refused =
      RunTool("accel-generate --model " + model_ + " --prompt hi --json_schema " + bad);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_THAT(refused.out, HasSubstr("keyword 'format'"));
}

TEST_F(GenerateToolTest, ChatMistakesAreNamed) {
  Result no_prompt = RunTool("accel-generate --model " + model_ + " --chat --input_ids 1,2");
  EXPECT_NE(no_prompt.exit_code, 0);
  EXPECT_THAT(no_prompt.out, HasSubstr("--chat and --system need --prompt"));
  Result system_only =
      RunTool("accel-generate --model " + model_ + " --system 'Be brief.' --input_ids 1");
  EXPECT_NE(system_only.exit_code, 0);
  EXPECT_THAT(system_only.out, HasSubstr("--chat and --system need --prompt"));
  ASSERT_EQ(std::remove((model_ + "/tokenizer_config.json").c_str()), 0);
  Result no_template = RunTool("accel-generate --model " + model_ + " --chat --prompt hi");
  EXPECT_NE(no_template.exit_code, 0);
  EXPECT_THAT(no_template.out, HasSubstr("--chat"));
  EXPECT_THAT(no_template.out, HasSubstr("has no chat template"));
}

TEST_F(GenerateToolTest, APromptIsTokenizedAndTheTextStreamsOut) {
  nlohmann::json j = Json("--prompt 'Hello there, world' --max_new_tokens 5 --ignore_eos");
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["token_ids"].size(), 5u);
  // Without --json the same text goes to stdout, the speed to stderr.
  Result plain = RunTool("accel-generate --model " + model_ +
                         " --prompt 'Hello there, world' --max_new_tokens 5 --ignore_eos");
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  EXPECT_THAT(plain.out, HasSubstr(j["text"].get<std::string>()));
  EXPECT_THAT(plain.out, HasSubstr("tokens/s"));
  EXPECT_THAT(plain.out, HasSubstr("finish: length"));
}

TEST_F(GenerateToolTest, WithoutModelItUsesTheDefaultModel) {
  const std::string flags = " --input_ids 5,6,7 --max_new_tokens 4 --ignore_eos --json";
  Result named = RunToolStdout("accel-generate --model " + model_ + flags);
  ASSERT_EQ(named.exit_code, 0) << named.out;
  // ACCEL_DEFAULT_MODEL stands in for share/accel/default-model beside bin/.
  Result fallback = RunToolStdout("accel-generate" + flags, "ACCEL_DEFAULT_MODEL=" + model_);
  ASSERT_EQ(fallback.exit_code, 0) << fallback.out;
  EXPECT_EQ(nlohmann::json::parse(fallback.out)["token_ids"],
            nlohmann::json::parse(named.out)["token_ids"]);
}

TEST_F(GenerateToolTest, OffloadedToDiskGeneratesTheSameTokens) {
  const std::string flags = "--input_ids 5,6,7,8 --max_new_tokens 6 --ignore_eos --dtype bfloat16 ";
  nlohmann::json in_ram = Json(flags + "--device_map cpu");
  nlohmann::json offloaded =
      Json(flags + "--max_memory cpu=60KB,disk=1GB --offload_folder " + dir_.path() + "/off");
  EXPECT_EQ(offloaded["token_ids"], in_ram["token_ids"]);
}

TEST_F(GenerateToolTest, BadInputIsAMessageAndExitOne) {
  auto fails = [&](const std::string& args, const std::string& message) {
    Result r = RunTool("accel-generate " + args);
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.out;
    EXPECT_THAT(r.out, HasSubstr(message)) << args;
  };
  const std::string m = "--model " + model_ + " ";
  {  // No --model: the default model, here one that is not there.
    Result r =
        RunTool("accel-generate --input_ids 1", "ACCEL_DEFAULT_MODEL=" + dir_.path() + "/gone");
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_THAT(r.out, HasSubstr(dir_.path() + "/gone")) << r.out;
  }
  fails(m + "--input_ids 1 stray", "unexpected argument 'stray'");
  fails(m, "exactly one of --prompt");
  fails(m + "--prompt hi --input_ids 1", "exactly one of --prompt");
  fails(m + "--input_ids 1,x", "'x' is not a token id");
  fails(m + "--input_ids 1,99999", "token id 99999");
  fails(m + "--input_ids 1 --dtype int8", "dtype 'int8'");
  fails(m + "--input_ids 1 --device_map moon", "device_map 'moon'");
  fails(m + "--input_ids 1 --temperature -2", "temperature");
  fails(m + "--input_ids 1 --max_new_tokens 0", "max_new_tokens");
  fails("--model " + dir_.path() + "/none --input_ids 1", "config.json");
  ASSERT_EQ(std::remove((model_ + "/tokenizer.json").c_str()), 0);
  fails(m + "--prompt hi", "tokenizer.json");
}

// ---- issue 32: a model twice its memory cgroup, with no load flags -----------

// Models about twice the limit the process sees: a dense llama and a small
// Mixtral, each loaded with no load flag. Their greedy tokens must be those of
// the model loaded fully in RAM, and the plan accel-generate prints must keep
// within the limit.
constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kCgroupLimit = 128 * kMiB;
constexpr const char* kPrompt = " --input_ids 1,2,3,4 --max_new_tokens 2 --ignore_eos --json";

class BiggerThanItsCgroupTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    const std::map<std::string, std::string> shapes = {
        {"llama", "--family llama --hidden_size 512"},
        {"mixtral", "--family mixtral --hidden_size 256 --num_experts 8"}};
    for (const auto& [name, flags] : shapes) {
      const std::string model = dir_->path() + "/" + name;
      Result made = RunTool("accel-make-model " + model + " " + flags +
                            " --vocab_size 1024 --size " + std::to_string(2 * kCgroupLimit));
      ASSERT_EQ(made.exit_code, 0) << made.out;
      Result in_ram =
          RunToolStdout("accel-generate --model " + model + kPrompt + " --device_map cpu");
      ASSERT_EQ(in_ram.exit_code, 0) << in_ram.out;
      (*models_)[name] = {model, nlohmann::json::parse(in_ram.out)["token_ids"]};
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  struct Model {
    std::string dir;
    nlohmann::json in_ram_tokens;
  };
  static TempDir* dir_;
  static std::map<std::string, Model>* models_;
};
TempDir* BiggerThanItsCgroupTest::dir_ = nullptr;
std::map<std::string, BiggerThanItsCgroupTest::Model>* BiggerThanItsCgroupTest::models_ =
    new std::map<std::string, BiggerThanItsCgroupTest::Model>;

// "36.1 MiB", "0 B" (how the tools print sizes) in bytes.
int64_t ParseShownBytes(const std::string& number, const std::string& unit) {
  const std::map<std::string, double> scale = {
      {"B", 1.0}, {"KiB", 1024.0}, {"MiB", 1024.0 * 1024}, {"GiB", 1024.0 * 1024 * 1024}};
  return static_cast<int64_t>(std::stod(number) * scale.at(unit));
}

// The memory plan accel-generate prints when weights are on disk.
struct PrintedPlan {
  int64_t weights = 0, expert_cache = 0, read_ahead = 0, budget = 0;
};
std::optional<PrintedPlan> PlanIn(const std::string& out) {
  static const RE2 kLine(
      R"(in memory: ([0-9.]+) (\w+) of weights, ([0-9.]+) (\w+) expert cache, ([0-9.]+) (\w+) )"
      R"(read-ahead, .* KV \(budget ([0-9.]+) (\w+)\))");
  std::string n[4], u[4];
  if (!RE2::PartialMatch(out, kLine, &n[0], &u[0], &n[1], &u[1], &n[2], &u[2], &n[3], &u[3])) {
    return std::nullopt;
  }
  return PrintedPlan{ParseShownBytes(n[0], u[0]), ParseShownBytes(n[1], u[1]),
                     ParseShownBytes(n[2], u[2]), ParseShownBytes(n[3], u[3])};
}

// Runs accel-generate on `model` with no load flags; `wrap` prefixes the
// command (an environment, or a shell that enters a cgroup first). Checks
// the tokens against the in-RAM load and the printed plan against `limit`.
void ExpectRunsWithinLimit(const std::string& model, const nlohmann::json& in_ram_tokens,
                           const std::string& wrap, int64_t limit) {
  const char* bin = std::getenv("ACCEL_BIN_DIR");
  Result run = test::CommandOutput(wrap + std::string(bin ? bin : "build/bin") +
                                   "/accel-generate --model " + model + kPrompt + " 2>&1");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const std::string json_line = run.out.substr(run.out.find("{\""));
  nlohmann::json out = nlohmann::json::parse(json_line.substr(0, json_line.find('\n')));
  EXPECT_EQ(out["token_ids"], in_ram_tokens) << run.out;
  std::optional<PrintedPlan> plan = PlanIn(run.out);
  ASSERT_TRUE(plan.has_value()) << "no weights were put on disk:\n" << run.out;
  // The probed budget is at most 85% of the limit, and what is planned to
  // stay in memory (weights, the expert cache) is within it. The read-ahead
  // buffers are reserved beside the budget; with them it still fits. (The
  // fixed reserves for the runtime and the KV cache are larger than this
  // limit by themselves: upper bounds, which the real run shows are not used.)
  EXPECT_LE(plan->budget, limit * 85 / 100) << run.out;
  EXPECT_LE(plan->weights + plan->expert_cache, plan->budget + kMiB / 100) << run.out;
  EXPECT_LE(plan->weights + plan->expert_cache + plan->read_ahead, limit * 85 / 100) << run.out;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  return static_cast<bool>(out);
}

// A folder laid out as a cgroup v2 mount whose own cgroup has `limit`, for
// $ACCEL_CGROUP_ROOT: whatever this machine's cgroups are, the process reads it.
TEST_F(BiggerThanItsCgroupTest, FakeCgroupRootRunsWithDefaults) {
  ASSERT_EQ(models_->size(), 2u);
  TempDir root;
  ASSERT_TRUE(WriteText(root.path() + "/memory.max", std::to_string(kCgroupLimit) + "\n"));
  ASSERT_TRUE(WriteText(root.path() + "/memory.current", "0\n"));
  ASSERT_TRUE(WriteText(root.path() + "/memory.stat", "active_file 0\ninactive_file 0\n"));
  for (const auto& [name, m] : *models_) {
    SCOPED_TRACE(name);
    ExpectRunsWithinLimit(m.dir, m.in_ram_tokens, "ACCEL_CGROUP_ROOT=" + root.path() + " ",
                          kCgroupLimit);
  }
  // Without the fake limit the model fits this machine: nothing goes to disk.
  const std::string& model = models_->at("llama").dir;
  Result unlimited = RunTool("accel-generate --model " + model + kPrompt);
  ASSERT_EQ(unlimited.exit_code, 0) << unlimited.out;
  EXPECT_FALSE(PlanIn(unlimited.out).has_value()) << unlimited.out;
}

// A real memory cgroup (v1 memory controller or v2 memory.max), made under
// the test's own: the kernel holds accel-generate to the limit, and the run
// must complete without the OOM killer. Needs the right to make cgroups
// (root with a writable cgroup mount); skipped, saying why, elsewhere.
TEST_F(BiggerThanItsCgroupTest, RealCgroupRunsWithDefaults) {
  ASSERT_EQ(models_->size(), 2u);
  std::string v1, v2;
  std::istringstream lines(ReadText("/proc/self/cgroup"));
  for (std::string line; std::getline(lines, line);) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.substr(0, a) == "0" && controllers.empty()) v2 = path;
    std::istringstream names(controllers);
    for (std::string c; std::getline(names, c, ',');) {
      if (c == "memory") v1 = path;
    }
  }
  std::string parent, limit_file, oom_file;
  if (!v1.empty() && access(("/sys/fs/cgroup/memory" + v1).c_str(), W_OK) == 0) {
    parent = "/sys/fs/cgroup/memory" + v1;
    limit_file = "memory.limit_in_bytes";
    oom_file = "memory.oom_control";
  } else if (!v2.empty() && access(("/sys/fs/cgroup" + v2).c_str(), W_OK) == 0) {
    parent = "/sys/fs/cgroup" + v2;
    limit_file = "memory.max";
    oom_file = "memory.events";
  } else {
    GTEST_SKIP() << "no writable memory cgroup for this process (v1 '" << v1 << "', v2 '" << v2
                 << "' under /sys/fs/cgroup): making one needs root and a cgroup mount";
  }
  const std::string cgroup = parent + "/accel-tools-test-" + std::to_string(getpid());
  if (mkdir(cgroup.c_str(), 0755) != 0) {
    GTEST_SKIP() << "cannot make the memory cgroup " << cgroup << ": " << std::strerror(errno);
  }
  struct Remove {
    std::string path;
    ~Remove() { rmdir(path.c_str()); }
  } remove{cgroup};
  if (!WriteText(cgroup + "/" + limit_file, std::to_string(kCgroupLimit))) {
    GTEST_SKIP() << "cannot set " << cgroup << "/" << limit_file
                 << " (v2: the parent's cgroup.subtree_control lacks memory)";
  }
  for (const auto& [name, m] : *models_) {
    SCOPED_TRACE(name);
    ExpectRunsWithinLimit(m.dir, m.in_ram_tokens,
                          "sh -c 'echo $$ > " + cgroup + "/cgroup.procs && exec \"$0\" \"$@\"' ",
                          kCgroupLimit);
  }
  EXPECT_THAT(ReadText(cgroup + "/" + oom_file), HasSubstr("oom_kill 0"));
}

}  // namespace
}  // namespace accel
