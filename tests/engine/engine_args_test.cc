// EngineArgs, the one owner of the load and engine options: every option
// of ModelLoadOptions and of the engine has its flag (set each to a value
// other than its default and read it back), and Resolve() refuses each bad
// option naming its flag, before anything of the model is read.
#include "engine/engine_args.h"

#include <optional>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/flags/reflection.h"

#include "models/make_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::engine {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::HasSubstr;

void Set(const std::string& name, const std::string& value) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  ASSERT_NE(flag, nullptr) << "--" << name << " is not a flag";
  std::string error;
  ASSERT_TRUE(flag->ParseFrom(value, &error)) << name << ": " << error;
}

TEST(EngineArgsTest, EveryLoadAndEngineOptionHasItsFlag) {
  EngineArgs::RegisterFlags();
  absl::FlagSaver restore;
  Set("model", "/m");
  Set("served_model_name", "tiny");
  Set("device_map", "sequential");
  Set("max_memory", "cpu=1GiB");
  Set("offload_folder", "/off");
  Set("dtype", "bfloat16");
  Set("quantize", "nf4");
  Set("double_quant", "true");
  Set("quant_blocksize", "128");
  Set("int8_threshold", "4.5");
  Set("quant_compute_dtype", "float32");
  Set("offload_experts", "true");
  Set("expert_cache", "2GiB");
  Set("execution_device", "cpu");
  Set("direct_reads", "true");
  Set("map_disk", "false");
  Set("prefetch", "false");
  Set("threads", "3");
  Set("max_batch_size", "5");
  Set("max_queue", "6");
  Set("max_num_batched_tokens", "7");
  Set("kv_cache_memory", "0.25");
  Set("gpu_memory_utilization", "0.75");
  Set("enforce_eager", "false");
  Set("kv_block_size", "8");
  Set("enable_prefix_caching", "false");
  Set("max_input_tokens", "9");
  Set("max_total_tokens", "10");
  Set("default_max_new_tokens", "11");
  Set("request_timeout", "12s");
  Set("speculative_config", R"({"method": "ngram", "num_speculative_tokens": 2})");
  Set("tensor_parallel_size", "2");
  Set("pipeline_parallel_size", "3");
  Set("pipeline_micro_batches", "4");
  Set("pipeline_batches_in_flight", "1");
  Set("nnodes", "2");
  Set("node_rank", "1");
  Set("master_addr", "10.0.0.1");
  Set("master_port", "29600");
  Set("parallel_timeout", "13s");
  const EngineArgs a = EngineArgs::FromFlags();
  EXPECT_EQ(a.model, "/m");
  EXPECT_EQ(a.served_model_name, "tiny");
  EXPECT_EQ(a.load.device_map, "sequential");
  EXPECT_EQ(a.load.max_memory, "cpu=1GiB");
  EXPECT_EQ(a.load.offload_folder, "/off");
  EXPECT_EQ(a.load.dtype, "bfloat16");
  EXPECT_EQ(a.load.quantize, "nf4");
  EXPECT_TRUE(a.load.double_quant);
  EXPECT_EQ(a.load.quant_blocksize, 128);
  EXPECT_EQ(a.load.int8_threshold, 4.5);
  EXPECT_EQ(a.load.quant_compute_dtype, "float32");
  EXPECT_EQ(a.load.offload_experts, "true");
  EXPECT_EQ(a.load.expert_cache, "2GiB");
  EXPECT_EQ(a.load.execution_device, "cpu");
  EXPECT_EQ(a.load.direct_reads, std::optional<bool>(true));
  EXPECT_FALSE(a.load.map_disk);
  EXPECT_FALSE(a.load.prefetch);
  EXPECT_EQ(a.threads, 3);
  EXPECT_EQ(a.max_batch_size, 5);
  EXPECT_EQ(a.max_queue, 6);
  EXPECT_EQ(a.max_num_batched_tokens, 7);
  EXPECT_EQ(a.kv_cache_memory, "0.25");
  EXPECT_EQ(a.gpu_memory_utilization, 0.75);
  EXPECT_FALSE(a.enforce_eager);
  EXPECT_EQ(a.kv_block_size, 8);
  EXPECT_FALSE(a.enable_prefix_caching);
  EXPECT_EQ(a.max_input_tokens, 9);
  EXPECT_EQ(a.max_total_tokens, 10);
  EXPECT_EQ(a.default_max_new_tokens, 11);
  EXPECT_EQ(a.request_timeout, absl::Seconds(12));
  EXPECT_THAT(a.speculative_config, HasSubstr("ngram"));
  EXPECT_EQ(a.parallel.tensor_parallel_size, 2);
  EXPECT_EQ(a.parallel.pipeline_parallel_size, 3);
  EXPECT_EQ(a.pipeline_micro_batches, 4);
  EXPECT_EQ(a.pipeline_batches_in_flight, 1);
  EXPECT_EQ(a.parallel.nnodes, 2);
  EXPECT_EQ(a.parallel.node_rank, 1);
  EXPECT_EQ(a.parallel.master_addr, "10.0.0.1");
  EXPECT_EQ(a.parallel.master_port, 29600);
  EXPECT_EQ(a.parallel_timeout, absl::Seconds(13));
}

class ResolveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    models::MakeModelOptions o;
    o.hidden_size = 32;
    o.vocab_size = 300;
    ASSERT_THAT(models::MakeModel(dir_.path() + "/m", o), IsOk());
    args_.model = dir_.path() + "/m";
  }
  void Bad(void (*set)(EngineArgs&), absl::StatusCode code, const std::string& message) {
    EngineArgs a = args_;
    set(a);
    EXPECT_THAT(a.Resolve(), StatusIs(code, HasSubstr(message))) << message;
  }
  TempDir dir_;
  EngineArgs args_;
};

TEST_F(ResolveTest, GoodArgsBecomeTheEngineOptions) {
  EngineArgs a = args_;
  a.max_batch_size = 4;
  a.load.device_map = "cpu";
  a.speculative_config = R"({"model": ")" + args_.model + R"(", "num_speculative_tokens": 3})";
  auto o = a.Resolve();
  ASSERT_THAT(o, IsOk());
  EXPECT_EQ(o->model_dir, args_.model);
  EXPECT_EQ(o->loop.max_batch_size, 4);
  EXPECT_EQ(o->load.device_map, "cpu");
  EXPECT_EQ(o->speculative.method, SpeculativeConfig::Method::kDraftModel);
  EXPECT_EQ(o->speculative.num_speculative_tokens, 3);
  EXPECT_EQ(o->gpu_memory_utilization, 0.9);  // vLLM's default
  EXPECT_TRUE(o->enforce_eager);              // until a device run has checked graphs
  a.gpu_memory_utilization = 1.0;
  a.enforce_eager = false;
  o = a.Resolve();
  ASSERT_THAT(o, IsOk());
  EXPECT_EQ(o->gpu_memory_utilization, 1.0);
  EXPECT_FALSE(o->enforce_eager);
  // The parallel options pass through as they are (the tool joins the group).
  a.parallel.pipeline_parallel_size = 2;
  a.pipeline_micro_batches = 1;
  a.pipeline_batches_in_flight = 3;
  a.parallel_timeout = absl::Seconds(5);
  o = a.Resolve();
  ASSERT_THAT(o, IsOk());
  EXPECT_EQ(o->parallel.pipeline_parallel_size, 2);
  EXPECT_EQ(o->pipeline_micro_batches, 1);
  EXPECT_EQ(o->pipeline_batches_in_flight, 3);
  EXPECT_EQ(o->parallel_timeout, absl::Seconds(5));
}

TEST_F(ResolveTest, EachBadOptionIsNamed) {
  using absl::StatusCode;
  Bad([](EngineArgs& a) { a.model = "/nonexistent"; }, StatusCode::kNotFound,
      "--model: /nonexistent/config.json does not exist");
  Bad([](EngineArgs& a) { a.load.dtype = "bogus"; }, StatusCode::kInvalidArgument,
      "--dtype 'bogus'");
  Bad([](EngineArgs& a) { a.load.device_map = "moon"; }, StatusCode::kInvalidArgument,
      "--device_map 'moon'");
  Bad([](EngineArgs& a) { a.load.device_map = "cuda:3"; }, StatusCode::kInvalidArgument, "no CUDA");
  Bad(
      [](EngineArgs& a) {
        a.load.device_map = "cpu";
        a.load.max_memory = "cpu=1GiB";
      },
      StatusCode::kInvalidArgument, "--max_memory plans a device map");
  Bad([](EngineArgs& a) { a.load.max_memory = "gpu=1GB"; }, StatusCode::kInvalidArgument,
      "--max_memory");
  Bad([](EngineArgs& a) { a.load.quantize = "int4"; }, StatusCode::kInvalidArgument,
      "--quantize 'int4'");
  Bad([](EngineArgs& a) { a.load.double_quant = true; }, StatusCode::kInvalidArgument,
      "--double_quant applies to 4-bit");
  Bad(
      [](EngineArgs& a) {
        a.load.quantize = "nf4";
        a.load.quant_blocksize = 3;
      },
      StatusCode::kInvalidArgument, "--quant_blocksize 3");
  Bad([](EngineArgs& a) { a.load.int8_threshold = -1; }, StatusCode::kInvalidArgument,
      "--int8_threshold -1");
  Bad([](EngineArgs& a) { a.load.quant_compute_dtype = "int8"; }, StatusCode::kInvalidArgument,
      "--quant_compute_dtype 'int8'");
  Bad([](EngineArgs& a) { a.load.offload_experts = "sometimes"; }, StatusCode::kInvalidArgument,
      "--offload_experts 'sometimes': expected auto, true or false");
  Bad([](EngineArgs& a) { a.load.expert_cache = "lots"; }, StatusCode::kInvalidArgument,
      "--expert_cache");
  Bad([](EngineArgs& a) { a.load.execution_device = "disk"; }, StatusCode::kInvalidArgument,
      "--execution_device 'disk'");
  Bad([](EngineArgs& a) { a.max_batch_size = 0; }, StatusCode::kInvalidArgument,
      "--max_batch_size must be at least 1");
  Bad([](EngineArgs& a) { a.max_queue = 0; }, StatusCode::kInvalidArgument,
      "--max_queue must be at least 1");
  Bad([](EngineArgs& a) { a.kv_block_size = 0; }, StatusCode::kInvalidArgument,
      "--kv_block_size must be at least 1");
  Bad([](EngineArgs& a) { a.max_num_batched_tokens = -1; }, StatusCode::kInvalidArgument,
      "--max_num_batched_tokens must be 0 or more");
  Bad([](EngineArgs& a) { a.default_max_new_tokens = 0; }, StatusCode::kInvalidArgument,
      "--default_max_new_tokens must be at least 1");
  Bad([](EngineArgs& a) { a.threads = -1; }, StatusCode::kInvalidArgument,
      "--threads must be 0 or more");
  Bad([](EngineArgs& a) { a.request_timeout = absl::Seconds(-1); }, StatusCode::kInvalidArgument,
      "--request_timeout must not be negative");
  Bad([](EngineArgs& a) { a.parallel.tensor_parallel_size = 0; }, StatusCode::kInvalidArgument,
      "--tensor_parallel_size must be at least 1");
  Bad([](EngineArgs& a) { a.parallel.pipeline_parallel_size = 0; }, StatusCode::kInvalidArgument,
      "--pipeline_parallel_size must be at least 1");
  Bad([](EngineArgs& a) { a.pipeline_micro_batches = -1; }, StatusCode::kInvalidArgument,
      "--pipeline_micro_batches must be 0 or more");
  Bad([](EngineArgs& a) { a.pipeline_batches_in_flight = -1; }, StatusCode::kInvalidArgument,
      "--pipeline_batches_in_flight must be 0 or more");
  Bad([](EngineArgs& a) { a.parallel_timeout = absl::ZeroDuration(); },
      StatusCode::kInvalidArgument, "--parallel_timeout must be positive");
  Bad([](EngineArgs& a) { a.kv_cache_memory = "lots"; }, StatusCode::kInvalidArgument,
      "--kv_cache_memory=lots");
  Bad([](EngineArgs& a) { a.kv_cache_memory = "1.5"; }, StatusCode::kInvalidArgument,
      "a fraction must be in (0, 1]");
  Bad([](EngineArgs& a) { a.gpu_memory_utilization = 0; }, StatusCode::kInvalidArgument,
      "--gpu_memory_utilization=0: the fraction of the device's memory this process may use "
      "must be in (0, 1]");
  Bad([](EngineArgs& a) { a.gpu_memory_utilization = 1.5; }, StatusCode::kInvalidArgument,
      "--gpu_memory_utilization=1.5");
  Bad([](EngineArgs& a) { a.speculative_config = R"({"method": "ngram"})"; },
      StatusCode::kInvalidArgument, R"(--speculative_config: "num_speculative_tokens")");
  Bad(
      [](EngineArgs& a) {
        a.speculative_config = R"({"model": "/x", "num_speculative_tokens": 1})";
      },
      StatusCode::kNotFound, "/x/config.json");
}

}  // namespace
}  // namespace accel::engine
