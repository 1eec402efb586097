#include "server/engine.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <utility>

#include <torch/nn/module.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "core/bytes.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/threads.h"
#include "dispatch/device_map.h"
#include "loader/config.h"
#include "models/generator.h"
#include "models/load_model.h"
#include "models/nn.h"
#include "models/sampling.h"
#include "server/internal/quote.h"
#include "server/server_metrics.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace accel::server {

struct Engine::Model {
  models::LoadedModel loaded;
  std::optional<tokenizer::Tokenizer> tokenizer;
  std::optional<tokenizer::ChatTemplate> chat_template;
  std::vector<int64_t> end_of_turn_ids;  // the template's turn ends, in the vocabulary
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

// The KV store's bytes as --kv_cache_memory asks.
absl::StatusOr<int64_t> KvCacheBytes(const EngineOptions& options,
                                     const std::map<std::string, int64_t>& bytes_per_device,
                                     int64_t max_total_tokens, int64_t block_size,
                                     int64_t block_bytes) {
  const std::string& spec = options.kv_cache_memory;
  double fraction = 0;
  const bool is_auto = spec.empty() || spec == "auto";
  if (!is_auto && spec.find('.') != std::string::npos && absl::SimpleAtod(spec, &fraction)) {
    if (!(fraction > 0 && fraction <= 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv_cache_memory=", spec, ": a fraction must be in (0, 1]; or give bytes (\"4GiB\")"));
    }
  } else if (!is_auto) {
    absl::StatusOr<int64_t> bytes = ParseByteSize(spec);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv_cache_memory=", spec,
          ": give bytes (\"4GiB\"), a fraction of the free memory (\"0.5\") or \"auto\"; ",
          bytes.status().message()));
    }
    return *bytes;
  }
  // What the device holding the most weights has free, now that they are in.
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
  if (!is_auto) return static_cast<int64_t>(fraction * available);
  const int64_t blocks_per_request = (max_total_tokens + block_size - 1) / block_size;
  const int64_t wanted =
      block_bytes * std::max<int64_t>(blocks_per_request * options.scheduler.max_batch_size, 1);
  return std::min<int64_t>(wanted, static_cast<int64_t>(0.5 * available));
}

}  // namespace

Engine::~Engine() {
  scheduler_.reset();  // joins the scheduler thread before the model goes
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Load(const EngineOptions& options,
                                                     ServerMetrics* metrics) {
  std::unique_ptr<Engine> engine(new Engine());
  engine->options_ = options;
  engine->metrics_ = metrics;
  engine->model_ = std::make_unique<Model>();
  Model& model = *engine->model_;
  const absl::Time start = absl::Now();
  SetIntraOpThreads(options.threads);

  // The tokenizer first: a bad one fails before minutes of loading.
  const std::string tokenizer_path = options.model_dir + "/tokenizer.json";
  if (std::filesystem::exists(tokenizer_path)) {
    ACCEL_ASSIGN_OR_RETURN(tokenizer::Tokenizer tokenizer,
                           tokenizer::Tokenizer::FromFile(tokenizer_path));
    ACCEL_ASSIGN_OR_RETURN(loader::ModelConfig config,
                           loader::ReadModelConfig(options.model_dir + "/config.json"));
    ACCEL_RETURN_IF_ERROR(models::CheckTokenizer(tokenizer, config, tokenizer_path));
    model.tokenizer.emplace(std::move(tokenizer));
    // The chat template too: a broken one is named now, not at the first chat.
    absl::StatusOr<tokenizer::ChatTemplate> chat =
        tokenizer::ChatTemplate::FromModelDir(options.model_dir);
    if (chat.ok()) {
      model.end_of_turn_ids = chat->EndOfTurnIds(*model.tokenizer);
      model.chat_template.emplace(*std::move(chat));
    } else if (!absl::IsNotFound(chat.status())) {
      return chat.status();
    }
  }
  models::ModelLoadOptions load;
  load.device_map = options.device_map;
  load.max_memory = options.max_memory;
  load.offload_folder = options.offload_folder;
  load.dtype = options.dtype;
  load.quantize = options.quantize;
  load.double_quant = options.double_quant;
  load.offload_experts = options.offload_experts;
  load.expert_cache = options.expert_cache;
  load.execution_device = options.execution_device;
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
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    // A packed 4-bit weight holds two parameters a byte.
    for (const auto& item : loaded.dispatched->module().named_modules()) {
      auto linear = std::dynamic_pointer_cast<nn::QuantizableLinear>(item.value());
      if (linear && linear->quantization().method == nn::LinearQuantization::Method::k4bit) {
        info.parameters += linear->in_features() * linear->out_features() - linear->weight.numel();
      }
    }
  }));
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
  info.has_tokenizer = model.tokenizer.has_value();
  info.has_chat_template = model.chat_template.has_value();
  info.load_seconds = absl::ToDoubleSeconds(absl::Now() - start);

  // The KV store: blocks of every layer's keys and values in the model's dtype.
  const int64_t block_size = std::max<int64_t>(options.kv_block_size, 1);
  const int64_t block_bytes =
      models::KvBlockStore::BytesPerBlock(loaded.config, loaded.dtype, block_size);
  ACCEL_ASSIGN_OR_RETURN(
      const int64_t kv_bytes,
      KvCacheBytes(options, info.bytes_per_device, info.max_total_tokens, block_size, block_bytes));
  const int64_t blocks = kv_bytes / block_bytes;
  if (blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_cache_memory=", options.kv_cache_memory, " holds no KV block (one takes ",
        FormatBytes(block_bytes), " with --kv_block_size=", block_size, ")"));
  }
  // A request can use at most what the store holds.
  if (blocks * block_size < info.max_total_tokens) {
    info.max_total_tokens = blocks * block_size;
    info.max_input_tokens = std::min(info.max_input_tokens, info.max_total_tokens - 1);
    engine->total_limit_name_ =
        absl::StrCat("the KV cache's ", info.max_total_tokens,
                     " tokens under --kv_cache_memory=", options.kv_cache_memory);
  }
  if (info.max_input_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_cache_memory=", options.kv_cache_memory, " holds ",
                     info.max_total_tokens, " tokens, no room for a prompt and a generated token"));
  }

  models::TextStreamFactory streams;
  if (model.tokenizer) streams = models::TokenizerTextStreams(*model.tokenizer);
  models::GeneratorOptions generator_options;
  generator_options.kv_cache_blocks = blocks;
  generator_options.block_size = block_size;
  generator_options.prefix_caching = options.enable_prefix_caching;
  generator_options.max_num_batched_tokens = options.max_num_batched_tokens;
  auto generator = std::make_unique<models::Generator>(loaded.model, loaded.dispatched.get(),
                                                       std::move(streams), generator_options);
  engine->scheduler_ =
      std::make_unique<Scheduler>(std::move(generator), options.scheduler, metrics);
  if (metrics != nullptr) {
    metrics->model_load_seconds.Set(info.load_seconds);
    for (const auto& [device, bytes] : info.bytes_per_device) {
      metrics->weight_bytes.WithLabels({device}).Set(static_cast<double>(bytes));
    }
  }
  return engine;
}

std::string Engine::TokenText(int64_t token_id) const {
  if (!model_->tokenizer) return "";
  const int64_t ids[] = {token_id};
  absl::StatusOr<std::string> text = model_->tokenizer->Decode(ids, /*skip_special_tokens=*/false);
  return text.ok() ? *std::move(text) : std::string();
}

dispatch::OffloadStats Engine::offload_stats() const { return model_->loaded.dispatched->stats(); }

absl::Status Engine::Complete(models::GenerationRequest& request) const {
  if (!request.model.empty() && request.model != info_.name) {
    return absl::NotFoundError(absl::StrCat("model ", internal::Quote(request.model),
                                            " is not served here; this server serves \"",
                                            info_.name, "\""));
  }
  if (request.chat.has_value()) {
    if (!model_->chat_template) {
      return absl::InvalidArgumentError(absl::StrCat(
          "messages: this model has no chat template (its folder has no chat_template.jinja "
          "and no chat_template in tokenizer_config.json); send a prompt instead"));
    }
    ACCEL_ASSIGN_OR_RETURN(
        const std::string text,
        model_->chat_template->Render(request.chat->messages_json, request.chat->tools_json,
                                      request.chat->add_generation_prompt));
    if (text.empty())
      return absl::InvalidArgumentError("messages: the chat template rendered nothing");
    // The template wrote the special tokens itself (transformers encodes
    // apply_chat_template's text without them too).
    ACCEL_ASSIGN_OR_RETURN(request.prompt_ids,
                           model_->tokenizer->Encode(text, /*add_special_tokens=*/false));
    if (!request.ignore_eos) {
      request.stop_token_ids.insert(request.stop_token_ids.end(), model_->end_of_turn_ids.begin(),
                                    model_->end_of_turn_ids.end());
    }
  } else if (request.prompt.has_value()) {
    if (request.prompt->empty()) return absl::InvalidArgumentError("prompt is empty");
    if (!model_->tokenizer) {
      return absl::InvalidArgumentError(
          "prompt: this model has no tokenizer.json; send input_ids instead");
    }
    ACCEL_ASSIGN_OR_RETURN(request.prompt_ids,
                           model_->tokenizer->Encode(*request.prompt, /*add_special_tokens=*/true));
  } else if (request.prompt_ids.empty()) {
    return absl::InvalidArgumentError("the request has neither a prompt nor input_ids");
  }
  models::RequestLimits limits;
  limits.vocab_size = info_.vocab_size;
  limits.max_input_tokens = info_.max_input_tokens;
  limits.max_total_tokens = info_.max_total_tokens;
  if (!total_limit_name_.empty()) limits.total_limit_name = total_limit_name_;
  limits.has_text_streams = model_->tokenizer.has_value();
  ACCEL_RETURN_IF_ERROR(models::ValidateGenerationRequest(request, limits));
  if (request.max_new_tokens == 0) {
    const int64_t room = info_.max_total_tokens - static_cast<int64_t>(request.prompt_ids.size());
    request.max_new_tokens = std::min(options_.default_max_new_tokens, room);
  }
  if (!request.ignore_eos) {
    request.stop_token_ids.insert(request.stop_token_ids.end(), info_.eos_token_ids.begin(),
                                  info_.eos_token_ids.end());
  }
  if (request.deadline != absl::InfiniteFuture() && request.deadline_reason.empty()) {
    request.deadline_reason = "the client's deadline";
  }
  if (options_.request_timeout > absl::ZeroDuration()) {
    const absl::Time limit = absl::Now() + options_.request_timeout;
    if (limit < request.deadline) {
      request.deadline = limit;
      request.deadline_reason =
          absl::StrCat("--request_timeout=", absl::FormatDuration(options_.request_timeout));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Engine::Submit(models::GenerationRequest request,
                                        std::shared_ptr<RequestSink> sink) {
  const absl::Status completed = Complete(request);
  absl::StatusOr<uint64_t> id = completed.ok()
                                    ? scheduler_->Submit(std::move(request), std::move(sink))
                                    : absl::StatusOr<uint64_t>(completed);
  if (!id.ok() && metrics_ != nullptr) {
    switch (id.status().code()) {
      case absl::StatusCode::kNotFound:
        metrics_->RequestFailed("not_found");
        break;
      case absl::StatusCode::kResourceExhausted:
        metrics_->RequestFailed("overloaded");
        break;
      case absl::StatusCode::kUnavailable:
        metrics_->RequestFailed("unavailable");
        break;
      default:
        metrics_->RequestFailed("invalid");
    }
  }
  return id;
}

}  // namespace accel::server
