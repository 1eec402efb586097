#include "engine/engine_args.h"

#include <filesystem>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "engine/gpu_memory.h"
#include "engine/kv_cache_manager.h"
#include "engine/speculative_config.h"
#include "models/default_model.h"

ABSL_FLAG(std::string, model, "",
          "A HuggingFace model folder (config.json, *.safetensors or pytorch_model.bin, "
          "tokenizer.json). Empty: the "
          "embedded default model (share/accel/default-model beside the binary's bin/, or "
          "$ACCEL_DEFAULT_MODEL).");
ABSL_FLAG(std::string, served_model_name, "",
          "The name clients use in requests; empty: the model folder's name.");
ABSL_FLAG(int, threads, 0,
          "libtorch intra-op threads; 0: OMP_NUM_THREADS, else one per CPU this process may use.");
ABSL_FLAG(int, max_batch_size, 32, "Most sequences in one decode step.");
ABSL_FLAG(int, max_queue, 256,
          "Most requests waiting to join the batch (at least 1: every request passes through "
          "it); past it: RESOURCE_EXHAUSTED with a retry-after-ms hint.");
ABSL_FLAG(int64_t, max_num_batched_tokens, 512,
          "Most tokens in one forward step: one per decoding sequence first, then drafts and "
          "chunks of prompts being read (chunked prefill), so decoding keeps its pace beside a "
          "long prompt; 0: whole prompts.");
ABSL_FLAG(std::string, kv_cache_memory, "auto",
          "KV-cache memory, in blocks allocated up front: bytes (\"4GiB\"), a fraction of what "
          "the device holding most weights has free after them (\"0.5\"), or auto (max_batch_size "
          "sequences of max_total_tokens, within half of what is free).");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "On a CUDA execution device, the fraction of the device's total memory this process "
          "may use (vLLM's meaning), in (0, 1]: with --kv_cache_memory=auto the KV cache gets "
          "total x this, less what the device holds after loading the weights, less the peak "
          "of a profiling forward of the largest step (--max_num_batched_tokens tokens). A "
          "--kv_cache_memory given explicitly takes precedence. No effect when the model runs "
          "on the cpu.");
ABSL_FLAG(bool, enforce_eager, true,
          "Never replay decode steps from CUDA graphs (vLLM's flag). false: on a CUDA execution "
          "device holding every weight of a dense model, a step whose sequences all decode one "
          "token is padded to a batch-size bucket (1, 2, 4, 8, then multiples of 8 up to "
          "--max_batch_size, at most 256) and replayed from a CUDA graph captured once per "
          "bucket; prefill, mixed steps and larger batches run eagerly. true by default until a "
          "device run has checked graphs against eager (vLLM's default is false). No effect when "
          "the model runs on the cpu.");
ABSL_FLAG(int64_t, kv_block_size, 16, "Tokens in one KV-cache block.");
ABSL_FLAG(bool, enable_prefix_caching, true,
          "Share the KV blocks of a common prompt prefix between requests.");
ABSL_FLAG(int64_t, max_input_tokens, 0, "Most prompt tokens; 0: the model's context - 1.");
ABSL_FLAG(int64_t, max_total_tokens, 0,
          "Most prompt + generated tokens per request; 0: the model's context.");
ABSL_FLAG(int64_t, default_max_new_tokens, 16, "max_new_tokens when a request leaves it 0.");
ABSL_FLAG(absl::Duration, request_timeout, absl::ZeroDuration(),
          "Longest a request may take, queue included (e.g. 60s); 0: no limit beyond the "
          "client's deadline.");
ABSL_FLAG(std::string, speculative_config, "",
          "Speculative decoding, as vLLM's --speculative-config (JSON): {\"method\": \"ngram\", "
          "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4} "
          "(prompt lookup) or {\"model\": DIR, \"num_speculative_tokens\": 4} (a draft model with "
          "this model's tokenizer; \"quantization\": its own). Empty: off.");

ABSL_FLAG(int, tensor_parallel_size, 1,
          "Split the model over this many ranks (Megatron-style tensor parallel: heads, MLP "
          "widths, experts and the vocabulary; docs/API.md). On one machine accel-serve (and "
          "accel-generate) starts ranks 1..N-1 itself; with --nnodes each node's accel-serve "
          "starts its share. Rank 0 serves the ports; the others serve gRPC health only, on "
          "--port + their local rank.");
ABSL_FLAG(int, pipeline_parallel_size, 1,
          "Split the model's layers into this many stages (pipeline parallel: consecutive layers "
          "per stage, as vLLM splits them; activations passed between stages). With "
          "--tensor_parallel_size N: N x M ranks, each stage split over N. Each step's "
          "sequences run as --pipeline_micro_batches micro-batches so that the stages overlap "
          "(docs/ARCHITECTURE.md).");
ABSL_FLAG(
    int, pipeline_micro_batches, 0,
    "With --pipeline_parallel_size M above 1: cut each step's sequences into this many "
    "micro-batches (never more than the step's sequences), which the stages run one "
    "behind another, so that stage s runs micro-batch k + 1 while stage s + 1 runs k. "
    "0 (auto): M, but none under 32 tokens (a decode step of a few sequences runs whole: each "
    "micro-batch reads the stage's weights again). 1: the whole step at once, the stages "
    "one after another.");
ABSL_FLAG(int, pipeline_batches_in_flight, 0,
          "With --pipeline_parallel_size M above 1: steps the leader keeps in flight, each over "
          "its own requests (about 1 / M of them), so that stage 0 runs step k + 1 while stage 1 "
          "runs step k (vLLM's virtual engines). 0 (auto): M. 1: one step at a time (each step's "
          "micro-batches still overlap the stages). Speculative decoding runs one at a time.");
ABSL_FLAG(int, nnodes, 1, "Machines of the group, as torchrun's --nnodes (each runs accel-serve).");
ABSL_FLAG(int, node_rank, 0, "This machine's index in [0, --nnodes), as torchrun's --node_rank.");
ABSL_FLAG(std::string, master_addr, "",
          "Node 0's address (its first rank hosts the group's rendezvous); needed with --nnodes "
          "above 1, 127.0.0.1 otherwise. MASTER_ADDR and the other variables of accel-launch / "
          "torchrun, when set, say which rank this process is instead.");
ABSL_FLAG(int, master_port, 29500, "The rendezvous port on --master_addr.");
ABSL_FLAG(absl::Duration, parallel_timeout, absl::Seconds(60),
          "A collective of the group that does not complete within this (a rank died or stopped "
          "answering) breaks the group: accel-serve's leader turns not ready, ends requests in "
          "flight with UNAVAILABLE, drains and exits with status 4; idle ranks hear from the "
          "leader every quarter of it.");

namespace accel::engine {
namespace {

absl::Status AtLeast(const char* flag, int64_t value, int64_t least) {
  if (value >= least) return absl::OkStatus();
  return absl::InvalidArgumentError(
      least == 1 ? absl::StrCat("--", flag, " must be at least 1, got ", value)
                 : absl::StrCat("--", flag, " must be 0 or more, got ", value));
}

}  // namespace

void EngineArgs::RegisterFlags() { models::RegisterLoadFlags(); }

EngineArgs EngineArgs::FromFlags() {
  EngineArgs a;
  a.model = absl::GetFlag(FLAGS_model);
  a.served_model_name = absl::GetFlag(FLAGS_served_model_name);
  a.load = models::LoadOptionsFromFlags();
  a.threads = absl::GetFlag(FLAGS_threads);
  a.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  a.max_queue = absl::GetFlag(FLAGS_max_queue);
  a.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  a.kv_cache_memory = absl::GetFlag(FLAGS_kv_cache_memory);
  a.gpu_memory_utilization = absl::GetFlag(FLAGS_gpu_memory_utilization);
  a.enforce_eager = absl::GetFlag(FLAGS_enforce_eager);
  a.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  a.enable_prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching);
  a.max_input_tokens = absl::GetFlag(FLAGS_max_input_tokens);
  a.max_total_tokens = absl::GetFlag(FLAGS_max_total_tokens);
  a.default_max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens);
  a.request_timeout = absl::GetFlag(FLAGS_request_timeout);
  a.speculative_config = absl::GetFlag(FLAGS_speculative_config);
  a.parallel.tensor_parallel_size = absl::GetFlag(FLAGS_tensor_parallel_size);
  a.parallel.pipeline_parallel_size = absl::GetFlag(FLAGS_pipeline_parallel_size);
  a.parallel.nnodes = absl::GetFlag(FLAGS_nnodes);
  a.parallel.node_rank = absl::GetFlag(FLAGS_node_rank);
  a.parallel.master_addr = absl::GetFlag(FLAGS_master_addr);
  a.parallel.master_port = absl::GetFlag(FLAGS_master_port);
  a.pipeline_micro_batches = absl::GetFlag(FLAGS_pipeline_micro_batches);
  a.pipeline_batches_in_flight = absl::GetFlag(FLAGS_pipeline_batches_in_flight);
  a.parallel_timeout = absl::GetFlag(FLAGS_parallel_timeout);
  return a;
}

absl::StatusOr<EngineOptions> EngineArgs::Resolve() const {
  for (absl::Status s :
       {AtLeast("max_batch_size", max_batch_size, 1), AtLeast("max_queue", max_queue, 1),
        AtLeast("kv_block_size", kv_block_size, 1),
        AtLeast("max_num_batched_tokens", max_num_batched_tokens, 0),
        AtLeast("max_input_tokens", max_input_tokens, 0),
        AtLeast("max_total_tokens", max_total_tokens, 0),
        AtLeast("default_max_new_tokens", default_max_new_tokens, 1),
        AtLeast("threads", threads, 0),
        AtLeast("tensor_parallel_size", parallel.tensor_parallel_size, 1),
        AtLeast("pipeline_parallel_size", parallel.pipeline_parallel_size, 1),
        AtLeast("pipeline_micro_batches", pipeline_micro_batches, 0),
        AtLeast("pipeline_batches_in_flight", pipeline_batches_in_flight, 0)}) {
    if (!s.ok()) return s;
  }
  if (request_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--request_timeout must not be negative");
  }
  if (parallel_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--parallel_timeout must be positive");
  }
  EngineOptions o;
  o.model_dir = model.empty() ? models::DefaultModelDir() : model;
  if (!std::filesystem::exists(o.model_dir + "/config.json")) {
    return absl::NotFoundError(
        absl::StrCat("--model: ", o.model_dir,
                     "/config.json does not exist (a HuggingFace model folder has "
                     "config.json, *.safetensors or pytorch_model.bin, and tokenizer.json)"));
  }
  if (absl::Status load_ok = models::CheckLoadOptions(load); !load_ok.ok()) {
    return absl::Status(load_ok.code(), absl::StrCat("--", load_ok.message()));
  }
  // The form only: how many blocks fit is known once the model is.
  ACCEL_RETURN_IF_ERROR(KvCacheBytes(kv_cache_memory, 1.0, 1).status());
  ACCEL_RETURN_IF_ERROR(CheckGpuMemoryUtilization(gpu_memory_utilization));
  ACCEL_ASSIGN_OR_RETURN(o.speculative, ParseSpeculativeConfig(speculative_config));
  if (o.speculative.method == SpeculativeConfig::Method::kDraftModel &&
      !std::filesystem::exists(o.speculative.model + "/config.json")) {
    return absl::NotFoundError(
        absl::StrCat("--speculative_config: \"model\": ", o.speculative.model,
                     "/config.json does not exist (the draft model's "
                     "folder)"));
  }
  o.served_model_name = served_model_name;
  o.load = load;
  o.threads = threads;
  o.loop.max_batch_size = max_batch_size;
  o.loop.max_queue = max_queue;
  o.max_num_batched_tokens = max_num_batched_tokens;
  o.kv_cache_memory = kv_cache_memory;
  o.gpu_memory_utilization = gpu_memory_utilization;
  o.enforce_eager = enforce_eager;
  o.kv_block_size = kv_block_size;
  o.enable_prefix_caching = enable_prefix_caching;
  o.max_input_tokens = max_input_tokens;
  o.max_total_tokens = max_total_tokens;
  o.default_max_new_tokens = default_max_new_tokens;
  o.request_timeout = request_timeout;
  o.parallel = parallel;
  o.pipeline_micro_batches = pipeline_micro_batches;
  o.pipeline_batches_in_flight = pipeline_batches_in_flight;
  o.parallel_timeout = parallel_timeout;
  return o;
}

}  // namespace accel::engine
