#include "engine/llm_engine.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/module.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/threads.h"
#include "dispatch/device_map.h"
#include "engine/decode_graphs.h"
#include "engine/engine_core.h"
#include "engine/gpu_memory.h"
#include "engine/grammar_logits_processor.h"
#include "engine/input_processor.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/output_processor.h"
#include "engine/penalty_logits_processor.h"
#include "engine/structured_output.h"
#include "loader/config.h"
#include "models/causal_lm.h"
#include "models/load_model.h"
#include "models/nn.h"

namespace accel::engine {

struct LlmEngine::Choices {
  absl::Mutex mu;
  std::map<uint64_t, std::vector<uint64_t>> groups ABSL_GUARDED_BY(mu);
};

struct LlmEngine::Model {
  models::LoadedModel loaded;
  std::optional<models::LoadedModel> draft;
  std::unique_ptr<InputProcessor> inputs;
  // Grammars against the vocabulary (set when the model has a tokenizer).
  std::shared_ptr<StructuredOutputCompiler> structured;
};

namespace {

std::string DeviceName(const Placement& placement) { return placement.ToString(); }

// The folder's own name, or "model" for "/".
std::string FolderName(const std::string& dir) {
  std::filesystem::path path(dir);
  if (!path.has_filename()) path = path.parent_path();
  const std::string name = path.filename().string();
  return name.empty() ? "model" : name;
}

// What the device holding the most weights has free, now that they are in.
absl::StatusOr<double> AvailableForKv(const std::map<std::string, int64_t>& bytes_per_device) {
  std::string main = "cpu";
  int64_t most = 0;
  for (const auto& [device, bytes] : bytes_per_device) {
    if (device != "disk" && bytes > most) {
      most = bytes;
      main = device;
    }
  }
  ACCEL_ASSIGN_OR_RETURN(dispatch::MaxMemory free, dispatch::ProbeMaxMemory());
  double available = 0;
  for (const auto& [placement, bytes] : free) {
    if (placement.ToString() == main) available = bytes;
  }
  return available;
}

// The largest step the engine runs, for --gpu_memory_utilization's
// profile: `tokens` ids as one prompt without a KV cache (its attention over
// all of them is the largest a step computes), logits for its last token as
// a step samples them. vLLM's profile_run, with a sequence of the largest
// step's length.
absl::Status RunProfileStep(const models::LoadedModel& loaded, int64_t tokens) {
  c10::InferenceMode inference;  // as the runner's steps: no autograd state kept
  at::Tensor ids;
  ACCEL_RETURN_IF_ERROR(
      CallTorch([&] { ids = at::zeros({tokens}, at::TensorOptions().dtype(at::kLong)); }));
  const models::SequenceChunk chunk{nullptr, tokens, 1};
  return loaded.model
      ->Forward(ids, absl::MakeConstSpan(&chunk, 1), models::Logits::kLastOfEach,
                loaded.dispatched.get())
      .status();
}

// Parameters and bytes per device of a loaded model, counted as
// transformers' num_parameters() does.
absl::Status CountParameters(const models::LoadedModel& loaded, ModelInfo& info) {
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    torch::nn::Module& module = loaded.dispatched->module();
    // Tied weights (an lm_head that is the embedding) are one tensor under two
    // names: counted once, as transformers' num_parameters() and the bytes do.
    std::set<const void*> seen;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
      info.parameters += item.value().numel();  // 4-bit weights: corrected below
      const std::optional<Placement> placement = loaded.device_map.Lookup(item.key());
      const std::string device = placement ? DeviceName(*placement) : "cpu";
      info.bytes_per_device[device] +=
          item.value().numel() * static_cast<int64_t>(item.value().element_size());
    }
  }));
  return CallTorch([&] {
    // A packed 4-bit weight holds two parameters a byte.
    for (const auto& item : loaded.dispatched->module().named_modules()) {
      auto linear = std::dynamic_pointer_cast<nn::QuantizableLinear>(item.value());
      if (linear && linear->quantization().method == nn::LinearQuantization::Method::k4bit) {
        info.parameters += linear->in_features() * linear->out_features() - linear->weight.numel();
      }
    }
  });
}

// The n choices of one request, as one sink: chunks carry their choice's
// index, a choice's end becomes its last chunk's finish, and the client's
// sink hears OnDone once, after the last choice, with every choice's tokens
// counted (OpenAI's usage.completion_tokens) and the first failure if any.
class ChoicesSink {
 public:
  // `counts_prompt[i]`: choice i is its prompt's first (its prompt tokens
  // count once in the usage).
  ChoicesSink(std::shared_ptr<RequestSink> sink, std::vector<bool> counts_prompt,
              std::function<void()> on_done)
      : sink_(std::move(sink)),
        counts_prompt_(std::move(counts_prompt)),
        left_(static_cast<int64_t>(counts_prompt_.size())),
        on_done_(std::move(on_done)) {}

  // Nothing reaches the client's sink any more (a later choice could not be
  // queued: the client got that error instead).
  void Abandon() {
    absl::MutexLock lock(&mu_);
    abandoned_ = true;
  }

  void OnTokens(int64_t index, TokenChunk chunk) {
    {
      absl::MutexLock lock(&mu_);
      if (abandoned_) return;
    }
    chunk.index = index;
    sink_->OnTokens(std::move(chunk));
  }

  void OnDone(int64_t index, const absl::Status& status, const Completion& completion) {
    bool last = false;
    Completion total;
    absl::Status first_error;
    {
      absl::MutexLock lock(&mu_);
      if (abandoned_) return;
      if (!status.ok() && status_.ok()) status_ = status;
      if (index == 0 || left_ == 0) done_ = completion;
      generated_ += completion.generated_tokens;
      const auto at = static_cast<size_t>(index);
      if (at < counts_prompt_.size() && counts_prompt_[at]) prompt_ += completion.prompt_tokens;
      longest_ = std::max(longest_, completion.total);
      last = --left_ == 0;
      if (last) {
        total = done_;
        total.generated_tokens = generated_;
        total.prompt_tokens = prompt_;
        total.total = longest_;
        first_error = status_;
      }
    }
    if (status.ok()) {
      TokenChunk end;
      end.index = index;
      end.finish = completion.finish;
      end.generated_tokens = completion.generated_tokens;
      sink_->OnTokens(std::move(end));
    }
    if (!last) return;
    if (on_done_) on_done_();
    sink_->OnDone(first_error, total);
  }

 private:
  const std::shared_ptr<RequestSink> sink_;
  const std::vector<bool> counts_prompt_;
  absl::Mutex mu_;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  int64_t left_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  Completion done_ ABSL_GUARDED_BY(mu_);  // choice 0's (its timings)
  int64_t generated_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t prompt_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration longest_ ABSL_GUARDED_BY(mu_);
  const std::function<void()> on_done_;
};

// One choice's sink: its events, tagged with its index, to the group.
class ChoiceSink : public RequestSink {
 public:
  ChoiceSink(std::shared_ptr<ChoicesSink> group, int64_t index)
      : group_(std::move(group)), index_(index) {}
  void OnTokens(TokenChunk chunk) override { group_->OnTokens(index_, std::move(chunk)); }
  void OnDone(const absl::Status& status, const Completion& completion) override {
    group_->OnDone(index_, status, completion);
  }

 private:
  const std::shared_ptr<ChoicesSink> group_;
  const int64_t index_;
};

}  // namespace

LlmEngine::~LlmEngine() {
  loop_.reset();  // joins the loop's thread before the models go
}

absl::StatusOr<std::unique_ptr<LlmEngine>> LlmEngine::Load(const EngineOptions& options,
                                                           StatLogger* stats) {
  std::unique_ptr<LlmEngine> engine(new LlmEngine());
  engine->choices_ = std::make_shared<Choices>();
  engine->options_ = options;
  engine->stats_ = stats;
  engine->model_ = std::make_unique<Model>();
  Model& model = *engine->model_;
  const absl::Time start = absl::Now();
  SetIntraOpThreads(options.threads);

  // The tokenizer and chat template first: a bad one fails before minutes
  // of loading.
  ACCEL_ASSIGN_OR_RETURN(model.inputs, InputProcessor::Load(options.model_dir));
  if (const tokenizer::Tokenizer* tokenizer = model.inputs->tokenizer()) {
    ACCEL_ASSIGN_OR_RETURN(loader::ModelConfig config,
                           loader::ReadModelConfig(options.model_dir + "/config.json"));
    ACCEL_RETURN_IF_ERROR(
        models::CheckTokenizer(*tokenizer, config, options.model_dir + "/tokenizer.json"));
  }
  const models::ModelLoadOptions& load = options.load;
  ACCEL_ASSIGN_OR_RETURN(model.loaded, models::LoadModel(options.model_dir, load));
  const models::LoadedModel& loaded = model.loaded;

  ModelInfo& info = engine->info_;
  info.name =
      options.served_model_name.empty() ? FolderName(options.model_dir) : options.served_model_name;
  info.architecture = loaded.config.architectures.empty() ? "" : loaded.config.architectures[0];
  info.model_type = loaded.config.model_type;
  info.dtype = std::string(DTypeName(loaded.dtype));
  if (!loaded.quantization.empty()) {
    info.quantization = loaded.quantization.begin()->second.ToString();
  }
  for (const auto& [module, placement] : loaded.device_map.entries()) {
    info.device_map.emplace_back(module, DeviceName(placement));
  }
  ACCEL_RETURN_IF_ERROR(CountParameters(loaded, info));

  // The draft model of speculative decoding, on the same dispatch core:
  // placed by the same device map strategy in what the target left, and
  // quantized as the target unless the config says otherwise.
  const SpeculativeConfig& spec = options.speculative;
  info.speculative_method = std::string(SpeculativeMethodName(spec.method));
  int64_t draft_block_bytes = 0;
  if (spec.method == SpeculativeConfig::Method::kDraftModel) {
    models::ModelLoadOptions draft_load = load;
    // The draft model runs whole on the leader: only the target is split.
    draft_load.tensor_parallel = models::TensorParallel();
    if (spec.quantization) {
      draft_load.quantize = *spec.quantization;
      if (draft_load.quantize != "nf4" && draft_load.quantize != "fp4") {
        draft_load.double_quant = false;
      }
    }
    absl::StatusOr<models::LoadedModel> draft = models::LoadModel(spec.model, draft_load);
    if (!draft.ok()) {
      return absl::Status(draft.status().code(),
                          absl::StrCat("--speculative_config: the draft model (\"model\"): ",
                                       draft.status().message()));
    }
    model.draft.emplace(*std::move(draft));
    info.draft_model = spec.model;
    ModelInfo draft_info;
    ACCEL_RETURN_IF_ERROR(CountParameters(*model.draft, draft_info));
    for (const auto& [device, bytes] : draft_info.bytes_per_device) {
      info.bytes_per_device[device] += bytes;
    }
  }

  const int64_t context = loaded.config.max_position_embeddings;
  info.max_context = context;
  info.max_total_tokens = options.max_total_tokens > 0 ? options.max_total_tokens : context;
  if (context > 0) info.max_total_tokens = std::min(info.max_total_tokens, context);
  info.max_input_tokens =
      options.max_input_tokens > 0 ? options.max_input_tokens : info.max_total_tokens - 1;
  info.max_input_tokens = std::min(info.max_input_tokens, info.max_total_tokens - 1);
  if (info.max_input_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_total_tokens=", info.max_total_tokens,
                     " leaves no room for a prompt and a generated token"));
  }
  info.vocab_size = loaded.config.vocab_size;
  info.eos_token_ids = loaded.eos_token_ids();
  info.disk_weight_bytes = loaded.memory.disk_weight_bytes;
  info.resident_weight_bytes = loaded.memory.resident_weight_bytes;
  info.expert_cache_bytes = loaded.memory.expert_cache_bytes;
  info.read_buffer_bytes = loaded.memory.read_buffer_bytes;
  info.planned_kv_cache_bytes = loaded.memory.kv_cache_bytes;
  info.memory_budget_bytes = loaded.memory.budget_bytes;
  info.direct_reads = loaded.memory.direct_reads;
  info.has_tokenizer = model.inputs->tokenizer() != nullptr;
  info.has_chat_template = model.inputs->has_chat_template();

  // The KV store: blocks of every layer's keys and values in the model's
  // dtype (and the draft model's, at the same block ids).
  const int64_t block_size = std::max<int64_t>(options.kv_block_size, 1);
  if (model.draft) {
    draft_block_bytes =
        models::KvBlockStore::BytesPerBlock(model.draft->config, model.draft->dtype, block_size);
  }
  const int64_t block_bytes =
      models::KvBlockStore::BytesPerBlock(loaded.config, loaded.dtype, block_size,
                                          options.load.tensor_parallel) +
      draft_block_bytes;
  const int64_t blocks_per_request = (info.max_total_tokens + block_size - 1) / block_size;
  std::optional<int64_t> kv_override_blocks;  // set by the GPU's sizing
  const int64_t wanted =
      block_bytes * std::max<int64_t>(blocks_per_request * options.loop.max_batch_size, 1);
  const bool kv_auto = options.kv_cache_memory.empty() || options.kv_cache_memory == "auto";
  // On a CUDA execution device with no KV size given: vLLM's sizing, what
  // --gpu_memory_utilization of the device leaves after the weights and the
  // largest step's activations (a --kv_cache_memory given by the user wins,
  // as vLLM's num_gpu_blocks_override does).
  const at::Device main_device = loaded.dispatched->main_device();
  if (kv_auto && main_device.is_cuda()) {
    ACCEL_RETURN_IF_ERROR(CheckGpuMemoryUtilization(options.gpu_memory_utilization));
    const int device = main_device.has_index() ? main_device.index() : 0;
    ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<DeviceMemoryProbe> probe, CudaMemoryProbe(device));
    const int64_t step_tokens = std::max<int64_t>(
        1, std::min(options.max_num_batched_tokens > 0 ? options.max_num_batched_tokens
                                                       : info.max_input_tokens,
                    info.max_total_tokens));
    ACCEL_ASSIGN_OR_RETURN(DeviceMemoryProfile profile, ProfileDeviceMemory(*probe, [&] {
                             return RunProfileStep(loaded, step_tokens);
                           }));
    ACCEL_ASSIGN_OR_RETURN(
        int64_t gpu_blocks,
        KvBlocksFromDeviceMemory(options.gpu_memory_utilization, profile, block_bytes));
    info.kv_sizing =
        absl::StrCat("--gpu_memory_utilization=", options.gpu_memory_utilization, " on ",
                     main_device.str(), ": ", profile.ToString(), " (a ", step_tokens,
                     "-token step) -> ", gpu_blocks, " blocks of ", FormatBytes(block_bytes));
    kv_override_blocks = gpu_blocks;
  }
  double available = 0;
  const bool probe =
      !kv_override_blocks && (kv_auto || options.kv_cache_memory.find('.') != std::string::npos);
  if (probe) {
    ACCEL_ASSIGN_OR_RETURN(available, AvailableForKv(info.bytes_per_device));
  }
  ACCEL_ASSIGN_OR_RETURN(int64_t kv_bytes,
                         KvCacheBytes(options.kv_cache_memory, available, wanted));
  // Auto stays within what loading set aside beside the weights (a model
  // that takes most of the memory): the memory probed now does not yet hold
  // the experts and buffers that loading planned to fill.
  if (kv_auto && !kv_override_blocks && loaded.memory.kv_cache_bytes >= 0) {
    kv_bytes = std::min(kv_bytes, loaded.memory.kv_cache_bytes);
  }
  const int64_t blocks = kv_override_blocks ? *kv_override_blocks : kv_bytes / block_bytes;
  info.kv_blocks = blocks;
  info.kv_block_bytes = block_bytes;
  if (info.kv_sizing.empty()) {
    info.kv_sizing = absl::StrCat("--kv_cache_memory=", options.kv_cache_memory, " -> ", blocks,
                                  " blocks of ", FormatBytes(block_bytes));
  }
  if (blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_cache_memory=", options.kv_cache_memory, " holds no KV block (one takes ",
        FormatBytes(block_bytes), " with --kv_block_size=", block_size, ")"));
  }
  std::string total_limit_name;  // set when the KV cache bounds max_total_tokens
  // A request can use at most what the store holds.
  if (blocks * block_size < info.max_total_tokens) {
    info.max_total_tokens = blocks * block_size;
    info.max_input_tokens = std::min(info.max_input_tokens, info.max_total_tokens - 1);
    total_limit_name = absl::StrCat("the KV cache's ", info.max_total_tokens,
                                    " tokens under --kv_cache_memory=", options.kv_cache_memory);
  }
  if (info.max_input_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_cache_memory=", options.kv_cache_memory, " holds ",
                     info.max_total_tokens, " tokens, no room for a prompt and a generated token"));
  }

  InputProcessorOptions inputs;
  inputs.served_model_name = info.name;
  inputs.limits.vocab_size = info.vocab_size;
  inputs.limits.max_input_tokens = info.max_input_tokens;
  inputs.limits.max_total_tokens = info.max_total_tokens;
  if (!total_limit_name.empty()) inputs.limits.total_limit_name = total_limit_name;
  inputs.default_max_new_tokens = options.default_max_new_tokens;
  inputs.eos_token_ids = info.eos_token_ids;
  inputs.request_timeout = options.request_timeout;
  model.inputs->Configure(std::move(inputs));

  ModelRunnerOptions runner_options;
  if (const tokenizer::Tokenizer* tokenizer = model.inputs->tokenizer()) {
    model.structured = std::make_shared<StructuredOutputCompiler>(*tokenizer, info.vocab_size);
  }
  // Per request: OpenAI's biases and penalties, then a grammar's mask.
  runner_options.logits_processors =
      [structured =
           model.structured](const GenerationRequest& request) -> std::unique_ptr<LogitsProcessor> {
    const auto prompt = static_cast<int64_t>(request.prompt_ids.size());
    std::vector<std::unique_ptr<LogitsProcessor>> parts;
    parts.push_back(MakePenaltyLogitsProcessor(request.sampling, prompt));
    parts.push_back(
        MakeMinTokensLogitsProcessor(request.stop_token_ids, request.min_tokens, prompt));
    if (request.structured && structured != nullptr) {
      // Compiled (and cached) when the request was submitted.
      auto compiled = structured->Compile(*request.structured);
      if (compiled.ok()) {
        parts.push_back(
            MakeGrammarLogitsProcessor(*std::move(compiled), request.stop_token_ids, prompt));
      }
    }
    return ChainLogitsProcessors(std::move(parts));
  };
  // CUDA graphs for decode steps (vLLM's; engine/decode_graphs.h): steps
  // whose sequences all decode one token are padded to a batch bucket and
  // replayed from a graph captured once per bucket. Only where the decode
  // step is capturable: every weight on the CUDA execution device (no
  // offload scopes), no LongRoPE or split model (SupportsStaticDecode), no
  // draft model; a mixture-of-experts model up to the rows its blocks route
  // on the device (MaxCapturedDecodeRows: 4 for Mixtral's NF4 experts), not
  // at all where they route on the host.
  bool resident = true;
  for (const auto& [module, placement] : loaded.device_map.entries()) {
    resident &= placement.is_cuda() && placement.index() == main_device.index();
  }
  const int64_t captured_rows = loaded.model->MaxCapturedDecodeRows();
  if (main_device.is_cuda() && !options.enforce_eager && resident && !model.draft &&
      captured_rows != 0 && loaded.model->SupportsStaticDecode()) {
    runner_options.decode_buckets = DecodeBatchBuckets(
        options.loop.max_batch_size, captured_rows > 0 ? captured_rows : kMaxDecodeBucket);
    runner_options.capture_decode_graphs = true;
    info.cuda_graph_buckets = runner_options.decode_buckets;
  }
  runner_options.num_blocks = blocks;
  runner_options.block_size = block_size;
  runner_options.speculative = spec;
  // Pipeline stages: steps in flight over disjoint requests (vLLM's
  // virtual engines). ModelRunner::Create keeps one with speculative
  // decoding (each step's drafts come from the step before it).
  if (loaded.model->pipeline_size() > 1) {
    runner_options.steps_in_flight = options.pipeline_batches_in_flight > 0
                                         ? options.pipeline_batches_in_flight
                                         : loaded.model->pipeline_size();
  }
  if (model.draft) {
    runner_options.draft_model = model.draft->model;
    runner_options.draft_dispatched = model.draft->dispatched.get();
  }
  ACCEL_ASSIGN_OR_RETURN(
      std::unique_ptr<ModelRunner> runner,
      ModelRunner::Create(loaded.model, loaded.dispatched.get(), std::move(runner_options)));
  TextStreamFactory streams;
  if (model.inputs->tokenizer() != nullptr) {
    streams = TokenizerTextStreams(*model.inputs->tokenizer());
  }
  EngineCoreOptions core_options;
  core_options.prefix_caching = options.enable_prefix_caching;
  core_options.max_num_batched_tokens = options.max_num_batched_tokens;
  auto core = std::make_unique<EngineCore>(std::move(runner), std::move(streams), core_options);
  info.load_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  engine->loop_ = std::make_unique<EngineLoop>(std::move(core), options.loop, stats);
  return engine;
}

const tokenizer::Tokenizer* LlmEngine::tokenizer() const { return model_->inputs->tokenizer(); }

absl::StatusOr<std::vector<int64_t>> LlmEngine::Tokenize(const GenerationRequest& request,
                                                         bool add_special_tokens) const {
  return model_->inputs->Tokenize(request, add_special_tokens);
}

std::string LlmEngine::TokenText(int64_t token_id) const {
  return model_->inputs->TokenText(token_id);
}

dispatch::OffloadStats LlmEngine::offload_stats() const {
  dispatch::OffloadStats stats = model_->loaded.dispatched->stats();
  if (model_->draft) stats += model_->draft->dispatched->stats();
  return stats;
}

void LlmEngine::Cancel(uint64_t id) {
  std::vector<uint64_t> ids = {id};
  {
    absl::MutexLock lock(&choices_->mu);
    auto found = choices_->groups.find(id);
    if (found != choices_->groups.end()) ids = found->second;
  }
  for (uint64_t each : ids) loop_->Cancel(each);
}

absl::StatusOr<uint64_t> LlmEngine::SubmitChoices(std::vector<GenerationRequest> requests,
                                                  std::shared_ptr<RequestSink> sink) {
  // Prompt p's choice j, in order: index p * n + j.
  std::vector<GenerationRequest> choices;
  std::vector<bool> counts_prompt;
  for (GenerationRequest& request : requests) {
    const int64_t n = request.n;
    request.n = 1;
    for (int64_t i = 0; i < n; ++i) {
      GenerationRequest choice = request;
      if (request.sampling.seed) choice.sampling.seed = *request.sampling.seed + i;
      choices.push_back(std::move(choice));
      counts_prompt.push_back(i == 0);
    }
  }
  const int64_t n = static_cast<int64_t>(choices.size());
  // The group's entry goes when the last choice ends; it may end before
  // every choice was queued only if queueing failed (then no entry is made).
  auto key = std::make_shared<std::optional<uint64_t>>();
  auto group = std::make_shared<ChoicesSink>(std::move(sink), std::move(counts_prompt),
                                             [groups = std::weak_ptr<Choices>(choices_), key] {
                                               std::shared_ptr<Choices> held = groups.lock();
                                               if (held == nullptr) return;
                                               absl::MutexLock lock(&held->mu);
                                               if (key->has_value()) held->groups.erase(**key);
                                             });
  std::vector<uint64_t> ids;
  // The map entry exists before any choice can end (the lock is held while
  // they are queued; ending takes it too).
  absl::MutexLock lock(&choices_->mu);
  for (int64_t i = 0; i < n; ++i) {
    absl::StatusOr<uint64_t> id = loop_->Submit(std::move(choices[static_cast<size_t>(i)]),
                                                std::make_shared<ChoiceSink>(group, i));
    if (!id.ok()) {
      group->Abandon();
      for (uint64_t queued : ids) loop_->Cancel(queued);
      return id.status();
    }
    ids.push_back(*id);
  }
  *key = ids.front();
  choices_->groups[ids.front()] = ids;
  return ids.front();
}

absl::Status LlmEngine::Complete(GenerationRequest& request) {
  ACCEL_RETURN_IF_ERROR(model_->inputs->Process(request));
  if (!request.structured) return absl::OkStatus();
  if (model_->structured == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(request.structured->field, ": structured output needs the model's tokenizer"));
  }
  if (request.stop_token_ids.empty()) {
    // The grammar ends the text with a stop token; without one the text
    // would run on past the grammar's end (ignore_eos and no stop ids).
    return absl::InvalidArgumentError(
        absl::StrCat(request.structured->field,
                     ": structured output needs a stop token to end the text (not ignore_eos "
                     "without stop_token_ids)"));
  }
  // A grammar that does not compile is the client's error, before it queues.
  return model_->structured->Compile(*request.structured).status();
}

void LlmEngine::RecordRefused(const absl::Status& status) {
  if (stats_ == nullptr) return;
  switch (status.code()) {
    case absl::StatusCode::kNotFound:
      stats_->RecordFailed("not_found");
      break;
    case absl::StatusCode::kResourceExhausted:
      stats_->RecordFailed("overloaded");
      break;
    case absl::StatusCode::kUnavailable:
      stats_->RecordFailed("unavailable");
      break;
    default:
      stats_->RecordFailed("invalid");
  }
}

absl::StatusOr<uint64_t> LlmEngine::Submit(GenerationRequest request,
                                           std::shared_ptr<RequestSink> sink) {
  std::vector<GenerationRequest> one;
  one.push_back(std::move(request));
  return SubmitBatch(std::move(one), std::move(sink));
}

absl::StatusOr<uint64_t> LlmEngine::SubmitBatch(std::vector<GenerationRequest> requests,
                                                std::shared_ptr<RequestSink> sink) {
  absl::Status completed =
      requests.empty() ? absl::InvalidArgumentError("prompt: no prompt") : absl::OkStatus();
  for (size_t p = 0; p < requests.size() && completed.ok(); ++p) {
    completed = Complete(requests[p]);
    if (!completed.ok() && requests.size() > 1) {
      completed =
          absl::Status(completed.code(), absl::StrCat(completed.message(), " (prompt ", p, ")"));
    }
  }
  absl::StatusOr<uint64_t> id = !completed.ok() ? absl::StatusOr<uint64_t>(completed)
                                : requests.size() == 1 && requests[0].n == 1
                                    ? loop_->Submit(std::move(requests[0]), std::move(sink))
                                    : SubmitChoices(std::move(requests), std::move(sink));
  if (!id.ok()) RecordRefused(id.status());
  return id;
}

}  // namespace accel::engine
