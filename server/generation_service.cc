#include "server/generation_service.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#include "core/json.h"
#include "core/status.h"
#include "engine/llm_engine.h"
#include "server/internal/openai_convert.h"
#include "server/internal/wire.h"
#include "server/internal/write_pump.h"
#include "server/server_metrics.h"

namespace accel::server {
namespace {

using accel::v1::ChatRequest;
using accel::v1::GenerateRequest;
using accel::v1::GenerateResponse;
using Json = nlohmann::ordered_json;  // keeps tool definitions and arguments in their order

// Which request a reactor serves: Generate* take a GenerateRequest, Chat* a
// ChatRequest; both become one engine::GenerationRequest.
enum class Method { kGenerate, kChat };

accel::v1::FinishReason ToProto(engine::Finish finish) {
  switch (finish) {
    case engine::Finish::kLength:
      return accel::v1::FINISH_REASON_LENGTH;
    case engine::Finish::kEos:
      return accel::v1::FINISH_REASON_EOS;
    case engine::Finish::kStop:
      return accel::v1::FINISH_REASON_STOP;
    case engine::Finish::kCancelled:
      return accel::v1::FINISH_REASON_CANCELLED;
  }
  return accel::v1::FINISH_REASON_UNSPECIFIED;
}

void SetSampling(const accel::v1::SamplingParameters& s, engine::SamplingParams& out) {
  out.temperature = s.temperature();
  out.top_k = s.top_k();
  // 0 is proto3's unset: the neutral value.
  out.top_p = s.top_p() == 0 ? 1.0 : s.top_p();
  out.min_p = s.min_p();
  out.repetition_penalty = s.repetition_penalty() == 0 ? 1.0 : s.repetition_penalty();
  if (s.has_seed()) out.seed = s.seed();
}

// The bounds of the JSON fields of one Chat request (tools_json,
// arguments_json), as the OpenAI API's bodies: depth, and the keys of all the
// fields together; the parse stops once the client has gone.
JsonLimits ChatJsonLimits(const grpc::ServerContextBase& context, int64_t* key_total) {
  JsonLimits limits;
  limits.max_depth = internal::kMaxOpenAiJsonDepth;
  limits.max_keys = internal::kMaxOpenAiJsonKeys;
  limits.key_total = key_total;
  limits.check = [&context] { return CallStillWanted(context); };
  return limits;
}

// The request's grammar (none when no kind is set).
std::optional<engine::StructuredOutputs> ToStructured(const accel::v1::StructuredOutput& in) {
  engine::StructuredOutputs out;
  switch (in.kind_case()) {
    case accel::v1::StructuredOutput::kJsonSchema:
      out.json_schema = in.json_schema();
      out.field = "structured_output.json_schema";
      break;
    case accel::v1::StructuredOutput::kJsonObject:
      if (!in.json_object()) return std::nullopt;
      out.json_object = true;
      out.field = "structured_output.json_object";
      break;
    case accel::v1::StructuredOutput::kRegex:
      out.regex = in.regex();
      out.field = "structured_output.regex";
      break;
    case accel::v1::StructuredOutput::kChoice:
      out.choice.assign(in.choice().choices().begin(), in.choice().choices().end());
      out.field = "structured_output.choice";
      break;
    case accel::v1::StructuredOutput::kGrammar:
      out.grammar = in.grammar();
      out.field = "structured_output.grammar";
      break;
    default:
      return std::nullopt;
  }
  return out;
}

// The messages as chat templates read them (transformers' shape: a tool
// call's arguments are an object, not the wire's JSON text).
absl::StatusOr<engine::GenerationRequest> ChatToParams(const ChatRequest& request,
                                                       const grpc::ServerContextBase& context) {
  if (request.messages().empty()) return absl::InvalidArgumentError("messages is empty");
  int64_t json_keys = 0;
  const JsonLimits limits = ChatJsonLimits(context, &json_keys);
  Json messages = Json::array();
  for (int i = 0; i < request.messages_size(); ++i) {
    const accel::v1::ChatMessage& m = request.messages(i);
    const std::string where = absl::StrCat("messages[", i, "]");
    if (m.role().empty()) return absl::InvalidArgumentError(absl::StrCat(where, ".role is empty"));
    Json message = {{"role", m.role()}};
    message["content"] = m.has_content() ? Json(m.content()) : Json(nullptr);
    if (!m.name().empty()) message["name"] = m.name();
    if (!m.tool_call_id().empty()) message["tool_call_id"] = m.tool_call_id();
    if (m.tool_calls_size() > 0) {
      Json calls = Json::array();
      for (int j = 0; j < m.tool_calls_size(); ++j) {
        const accel::v1::ToolCall& call = m.tool_calls(j);
        const std::string call_where = absl::StrCat(where, ".tool_calls[", j, "]");
        Json arguments = Json::object();
        if (!call.arguments_json().empty()) {
          ACCEL_ASSIGN_OR_RETURN(
              arguments,
              ParseOrderedJson(call.arguments_json(), call_where + ".arguments_json", limits));
        }
        Json function = {{"name", call.name()}, {"arguments", std::move(arguments)}};
        Json entry = {{"type", call.type().empty() ? "function" : call.type()},
                      {"function", std::move(function)}};
        if (!call.id().empty()) entry["id"] = call.id();
        calls.push_back(std::move(entry));
      }
      message["tool_calls"] = std::move(calls);
    }
    messages.push_back(std::move(message));
  }
  Json tools = Json::array();
  for (int i = 0; i < request.tools_json_size(); ++i) {
    ACCEL_ASSIGN_OR_RETURN(
        Json tool,
        ParseOrderedJson(request.tools_json(i), absl::StrCat("tools_json[", i, "]"), limits));
    if (!tool.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat("tools_json[", i, "]: expected an object"));
    }
    tools.push_back(std::move(tool));
  }
  engine::GenerationRequest params;
  params.model = request.model();
  engine::ChatInput chat;
  chat.messages_json = messages.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (!tools.empty()) chat.tools_json = tools.dump(-1, ' ', false, Json::error_handler_t::replace);
  chat.add_generation_prompt = request.add_generation_prompt();
  params.chat = std::move(chat);
  params.max_new_tokens = request.max_new_tokens();
  SetSampling(request.sampling(), params.sampling);
  params.stop_strings.assign(request.stop().begin(), request.stop().end());
  params.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  params.ignore_eos = request.ignore_eos();
  params.logprobs = request.return_logprobs();
  params.structured = ToStructured(request.structured_output());
  params.deadline = CallDeadline(context);
  return params;
}

engine::GenerationRequest ToParams(const GenerateRequest& request,
                                   const grpc::ServerContextBase& context) {
  engine::GenerationRequest params;
  params.model = request.model();
  if (request.input_case() == GenerateRequest::kPrompt) {
    params.prompt = request.prompt();
  } else {
    params.prompt_ids.assign(request.input_ids().ids().begin(), request.input_ids().ids().end());
  }
  params.max_new_tokens = request.max_new_tokens();
  SetSampling(request.sampling(), params.sampling);
  params.stop_strings.assign(request.stop().begin(), request.stop().end());
  params.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  params.ignore_eos = request.ignore_eos();
  params.logprobs = request.return_logprobs();
  params.structured = ToStructured(request.structured_output());
  params.deadline = CallDeadline(context);
  return params;
}

void AppendChunk(const engine::TokenChunk& chunk, GenerateResponse& out) {
  out.mutable_token_ids()->Add(chunk.token_ids.begin(), chunk.token_ids.end());
  out.mutable_logprobs()->Add(chunk.logprobs.begin(), chunk.logprobs.end());
  out.mutable_text()->append(chunk.text);
}

void SetCompletion(const engine::Completion& completion, GenerateResponse& out) {
  out.set_finish_reason(ToProto(completion.finish));
  out.mutable_usage()->set_prompt_tokens(completion.prompt_tokens);
  out.mutable_usage()->set_generated_tokens(completion.generated_tokens);
  out.mutable_timing()->set_queue_seconds(absl::ToDoubleSeconds(completion.queue_time));
  out.mutable_timing()->set_time_to_first_token_seconds(
      absl::ToDoubleSeconds(completion.time_to_first_token));
  out.mutable_timing()->set_total_seconds(absl::ToDoubleSeconds(completion.total));
}

// What both reactors share with their sink about the request itself.
struct CallState {
  absl::Mutex mu;
  engine::LlmEngine* engine ABSL_GUARDED_BY(mu) = nullptr;
  std::optional<uint64_t> id ABSL_GUARDED_BY(mu);
  bool cancelled ABSL_GUARDED_BY(mu) = false;

  // The client went away: stop the request (now, or once its id is known).
  // A call whose deadline came is left to the scheduler, which ends it for
  // that deadline before its next step (counted as a timeout).
  void Cancel(const grpc::ServerContextBase& context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (DeadlineReached(context)) return;
    cancelled = true;
    if (id && engine != nullptr) engine->Cancel(*id);
  }
};

// Parses, authorizes, validates and submits a request for `call`; the status
// to finish the call with when that fails.
absl::StatusOr<engine::GenerationRequest> ParseParams(Method method, const grpc::ByteBuffer& body,
                                                      const grpc::ServerContextBase& context) {
  if (method == Method::kChat) {
    ChatRequest request;
    ACCEL_RETURN_IF_ERROR(internal::ParseBody(body, request));
    return ChatToParams(request, context);
  }
  GenerateRequest request;
  ACCEL_RETURN_IF_ERROR(internal::ParseBody(body, request));
  return ToParams(request, context);
}

grpc::Status Start(Method method, ServingState& state, grpc::CallbackServerContext& context,
                   const grpc::ByteBuffer& body, std::shared_ptr<engine::RequestSink> sink,
                   CallState& call) {
  grpc::Status auth = state.Authorize(context);
  if (!auth.ok()) return auth;
  absl::StatusOr<engine::GenerationRequest> params = ParseParams(method, body, context);
  if (!params.ok()) {
    if (state.metrics() != nullptr) {
      const absl::StatusCode code = params.status().code();
      state.metrics()->RequestFailed(code == absl::StatusCode::kDeadlineExceeded ? "timeout"
                                     : code == absl::StatusCode::kCancelled      ? "cancelled"
                                                                                 : "invalid");
    }
    return ToGrpcStatus(params.status());
  }
  absl::StatusOr<engine::LlmEngine*> engine = state.ReadyEngine();
  if (!engine.ok()) return ToGrpcStatus(engine.status());
  // Nobody to answer: nothing is queued (the scheduler would only drop it).
  if (absl::Status wanted = CallStillWanted(context); !wanted.ok()) {
    return ToGrpcStatus(wanted);
  }
  absl::StatusOr<uint64_t> id = (*engine)->Submit(*std::move(params), std::move(sink));
  if (!id.ok()) {
    if (absl::IsResourceExhausted(id.status())) AddRetryHint(context);
    return ToGrpcStatus(id.status());
  }
  absl::MutexLock lock(&call.mu);
  call.id = *id;
  call.engine = *engine;
  // Cancelled before the id was known: pass it on now.
  if (call.cancelled) call.engine->Cancel(*id);
  return grpc::Status::OK;
}

// Unary Generate: the sink fills the response and finishes the call. The
// reactor and the sink share Call; the reactor leaves it (reactor = null)
// in OnDone, after which the sink must not touch it.
class GenerateReactor : public grpc::ServerUnaryReactor {
 public:
  struct Call : CallState {
    GenerateReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;
    GenerateResponse response ABSL_GUARDED_BY(mu);
    grpc::ByteBuffer* body ABSL_GUARDED_BY(mu) = nullptr;  // gRPC's, where the answer goes
  };

  class Sink : public engine::RequestSink {
   public:
    explicit Sink(std::shared_ptr<Call> call) : call_(std::move(call)) {}
    void OnTokens(engine::TokenChunk chunk) override {
      absl::MutexLock lock(&call_->mu);
      AppendChunk(chunk, call_->response);
    }
    void OnDone(const absl::Status& status, const engine::Completion& completion) override {
      GenerateReactor* reactor = nullptr;
      {
        absl::MutexLock lock(&call_->mu);
        if (call_->reactor == nullptr) return;
        if (status.ok()) {
          SetCompletion(completion, call_->response);
          *call_->body = internal::SerializeBody(call_->response);
        }
        reactor = call_->reactor;
      }
      // Outside the lock: gRPC may run callbacks that take it on this
      // thread. The reactor lives until its OnDone, which comes only after
      // this Finish, the one Finish of a submitted call.
      reactor->Finish(ToGrpcStatus(status));
    }

   private:
    std::shared_ptr<Call> call_;
  };

  GenerateReactor(Method method, ServingState* state, grpc::CallbackServerContext* context,
                  const grpc::ByteBuffer* request, grpc::ByteBuffer* response)
      : context_(context), call_(std::make_shared<Call>()) {
    {
      absl::MutexLock lock(&call_->mu);
      call_->reactor = this;
      call_->body = response;
    }
    grpc::Status started =
        Start(method, *state, *context, *request, std::make_shared<Sink>(call_), *call_);
    if (!started.ok()) Finish(started);
  }

  void OnCancel() override {
    absl::MutexLock lock(&call_->mu);
    call_->Cancel(*context_);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&call_->mu);
      call_->reactor = nullptr;
      call_->body = nullptr;
    }
    delete this;
  }

 private:
  grpc::CallbackServerContext* const context_;
  std::shared_ptr<Call> call_;
};

// GenerateStream: the request's chunks go out through a WritePump; chunks
// produced while a write is in flight are merged into the next message.
class StreamReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  // What the stream has to say next: every chunk since the last write.
  struct News : internal::WritePump::Source {
    absl::Mutex mu;
    std::optional<GenerateResponse> next ABSL_GUARDED_BY(mu);

    std::optional<grpc::ByteBuffer> TakeMessage() override {
      absl::MutexLock lock(&mu);
      if (!next) return std::nullopt;
      grpc::ByteBuffer message = internal::SerializeBody(*next);
      next.reset();
      return message;
    }
  };

  class Sink : public engine::RequestSink {
   public:
    Sink(std::shared_ptr<internal::WritePump> pump, std::shared_ptr<News> news)
        : pump_(std::move(pump)), news_(std::move(news)) {}
    void OnTokens(engine::TokenChunk chunk) override {
      {
        absl::MutexLock lock(&news_->mu);
        if (!news_->next) news_->next.emplace();
        AppendChunk(chunk, *news_->next);
      }
      pump_->Notify(news_);
    }
    void OnDone(const absl::Status& status, const engine::Completion& completion) override {
      if (status.ok()) {
        {
          absl::MutexLock lock(&news_->mu);
          if (!news_->next) news_->next.emplace();
          SetCompletion(completion, *news_->next);
        }
        pump_->Notify(news_);
      }
      pump_->FinishAfterWrites(ToGrpcStatus(status));
    }

   private:
    const std::shared_ptr<internal::WritePump> pump_;
    const std::shared_ptr<News> news_;
  };

  StreamReactor(Method method, ServingState* state, grpc::CallbackServerContext* context,
                const grpc::ByteBuffer* request)
      : context_(context),
        pump_(std::make_shared<internal::WritePump>(
            [this](const grpc::ByteBuffer* message) { StartWrite(message); },
            [this](const grpc::Status& status) { Finish(status); })) {
    grpc::Status started = Start(method, *state, *context, *request,
                                 std::make_shared<Sink>(pump_, std::make_shared<News>()), call_);
    if (!started.ok()) pump_->FinishAfterWrites(started);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      // The client is gone: stop generating.
      absl::MutexLock lock(&call_.mu);
      call_.Cancel(*context_);
    }
    pump_->OnWriteDone(ok);
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&call_.mu);
      call_.Cancel(*context_);
    }
    pump_->Abort(grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"));
  }

  void OnDone() override {
    pump_->Detach();
    delete this;
  }

 private:
  grpc::CallbackServerContext* const context_;
  // The sink reaches the call only through the pump, which Detach cuts off;
  // `call_` is the reactor's own.
  CallState call_;
  const std::shared_ptr<internal::WritePump> pump_;
};

}  // namespace

grpc::ServerUnaryReactor* GenerationService::Generate(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  return new GenerateReactor(Method::kGenerate, state_, context, request, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerationService::GenerateStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new StreamReactor(Method::kGenerate, state_, context, request);
}

grpc::ServerUnaryReactor* GenerationService::Chat(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) {
  return new GenerateReactor(Method::kChat, state_, context, request, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerationService::ChatStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new StreamReactor(Method::kChat, state_, context, request);
}

grpc::ServerUnaryReactor* GenerationService::GetModelInfo(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* body,
                                                          grpc::ByteBuffer* out) {
  return internal::AnswerRaw<accel::v1::GetModelInfoRequest, accel::v1::ModelInfo>(
      context, *body, out, [this, context](const auto&, accel::v1::ModelInfo* response) {
        return AnswerGetModelInfo(*context, response);
      });
}

grpc::Status GenerationService::AnswerGetModelInfo(grpc::CallbackServerContext& context,
                                                   accel::v1::ModelInfo* response) {
  grpc::Status auth = state_->Authorize(context);
  if (!auth.ok()) return auth;
  engine::LlmEngine* engine = state_->engine();
  if (engine == nullptr) {
    return ToGrpcStatus(absl::UnavailableError("the model is still loading"));
  }
  const engine::ModelInfo& info = engine->info();
  response->set_name(info.name);
  response->set_architecture(info.architecture);
  response->set_model_type(info.model_type);
  response->set_parameters(info.parameters);
  response->set_dtype(info.dtype);
  response->set_quantization(info.quantization);
  for (const auto& [module, device] : info.device_map) {
    accel::v1::DevicePlacement* placement = response->add_device_map();
    placement->set_module(module);
    placement->set_device(device);
  }
  for (const auto& [device, bytes] : info.bytes_per_device) {
    (*response->mutable_bytes_per_device())[device] = bytes;
  }
  response->set_max_context(info.max_context);
  response->set_max_input_tokens(info.max_input_tokens);
  response->set_max_total_tokens(info.max_total_tokens);
  response->set_vocab_size(info.vocab_size);
  response->mutable_eos_token_ids()->Add(info.eos_token_ids.begin(), info.eos_token_ids.end());
  response->set_has_chat_template(info.has_chat_template);
  return grpc::Status::OK;
}

}  // namespace accel::server
