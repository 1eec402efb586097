#include "server/kserve_service.h"

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#include "core/status.h"
#include "engine/llm_engine.h"
#include "server/internal/kserve_convert.h"
#include "server/internal/quote.h"
#include "server/internal/wire.h"
#include "server/internal/write_pump.h"
#include "server/server_metrics.h"

namespace accel::server {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStreamInferResponse;
using internal::GenerationResult;
using internal::KServeRequest;

// The one version of the served model.
constexpr char kModelVersion[] = "1";

// OK when `name` and `version` address the served model ("" means it).
absl::Status CheckModel(const engine::LlmEngine& engine, const std::string& name,
                        const std::string& version) {
  const std::string& served = engine.info().name;
  if (!name.empty() && name != served) {
    return absl::NotFoundError(absl::StrCat("model ", internal::Quote(name),
                                            " is not served here; this server serves \"", served,
                                            "\""));
  }
  if (!version.empty() && version != kModelVersion) {
    return absl::NotFoundError(absl::StrCat("model \"", served, "\" has no version ",
                                            internal::Quote(version), "; its only version is \"",
                                            kModelVersion, "\""));
  }
  return absl::OkStatus();
}

// The engine to run `request` on, or the status to answer with.
absl::StatusOr<engine::LlmEngine*> EngineFor(const ServingState& state,
                                             const ModelInferRequest& request) {
  absl::StatusOr<engine::LlmEngine*> engine = state.ReadyEngine();
  if (!engine.ok()) return engine.status();
  ACCEL_RETURN_IF_ERROR(CheckModel(**engine, request.model_name(), request.model_version()));
  return engine;
}

// How a prompt's end reads as a status: the sink's, or for a request the
// server itself stopped (a drain past its grace period), Unavailable, so
// the client retries elsewhere rather than take a cut-short answer as whole.
absl::Status EndStatus(const absl::Status& status, const engine::Completion& completion) {
  if (!status.ok()) return status;
  if (completion.finish == engine::Finish::kCancelled) {
    return absl::UnavailableError(
        "the server ended the request before it finished (it is shutting down); retry on "
        "another replica");
  }
  return absl::OkStatus();
}

// Says which prompt failed when there are several, and which input an
// engine complaint ("prompt is empty") is about.
absl::Status ForPrompt(const absl::Status& status, const KServeRequest& request, size_t i) {
  if (status.ok() || (request.num_prompts() == 1 && !absl::IsInvalidArgument(status))) {
    return status;
  }
  return absl::Status(status.code(),
                      absl::StrCat(internal::PromptName(request, i), ": ", status.message()));
}

void AppendChunk(const engine::TokenChunk& chunk, GenerationResult& result) {
  result.text += chunk.text;
  result.token_ids.insert(result.token_ids.end(), chunk.token_ids.begin(), chunk.token_ids.end());
  result.logprobs.insert(result.logprobs.end(), chunk.logprobs.begin(), chunk.logprobs.end());
}

void SetCompletion(const engine::Completion& completion, GenerationResult& result) {
  result.finish_reason = engine::FinishName(completion.finish);
  result.prompt_tokens = completion.prompt_tokens;
  result.generated_tokens = completion.generated_tokens;
}

void SetFinal(bool final, ModelInferResponse& response) {
  (*response.mutable_parameters())[internal::kFinalResponse].set_bool_param(final);
}

// ---------------------------------------------------------------------------
// ModelInfer: every prompt is submitted at once and a sink per prompt
// collects its result; the call finishes when the last prompt ends, or at
// the first failure (the others are cancelled then).

class InferReactor : public grpc::ServerUnaryReactor {
 public:
  // Shared by the reactor and the sinks; the scheduler keeps sinks (and so
  // this) after the call is over, which `reactor` null tells them.
  struct Call {
    Call(std::shared_ptr<const KServeRequest> request, engine::LlmEngine* engine)
        : request(std::move(request)), engine(engine) {}
    const std::shared_ptr<const KServeRequest> request;
    engine::LlmEngine* const engine;

    absl::Mutex mu;
    InferReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;  // null once OnDone ran
    ModelInferResponse response ABSL_GUARDED_BY(mu);
    grpc::ByteBuffer* body ABSL_GUARDED_BY(mu) = nullptr;  // gRPC's, where the answer goes
    grpc::CallbackServerContext* context ABSL_GUARDED_BY(mu) = nullptr;
    std::vector<GenerationResult> results ABSL_GUARDED_BY(mu);
    std::vector<uint64_t> ids ABSL_GUARDED_BY(mu);  // submitted so far
    size_t ended ABSL_GUARDED_BY(mu) = 0;
    bool all_submitted ABSL_GUARDED_BY(mu) = false;
    // Finish was decided: from then on nothing touches the response, and
    // only the thread that decided it calls Finish.
    bool finished ABSL_GUARDED_BY(mu) = false;

    // The Finish to call once the lock is released (gRPC may run reactions
    // that take the lock on the calling thread), and the ids to cancel.
    struct Action {
      InferReactor* reactor = nullptr;
      grpc::Status status;
      std::vector<uint64_t> cancel;
    };

    Action FinishWith(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      Action action;
      if (finished || reactor == nullptr) return action;
      finished = true;
      action.reactor = reactor;
      action.status = ToGrpcStatus(status);
      if (!status.ok()) {
        action.cancel = ids;
        if (absl::IsResourceExhausted(status)) AddRetryHint(*context);
      }
      return action;
    }

    // Fills the response when every prompt has ended.
    Action MaybeAnswer() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      if (finished || reactor == nullptr || !all_submitted || ended < results.size()) return {};
      internal::BuildInferResponse(*request, results, /*final=*/true, &response);
      *body = internal::SerializeBody(response);
      return FinishWith(absl::OkStatus());
    }

    void Run(const Action& action) {
      for (uint64_t id : action.cancel) engine->Cancel(id);
      if (action.reactor != nullptr) action.reactor->Finish(action.status);
    }
  };

  class Sink : public engine::RequestSink {
   public:
    Sink(std::shared_ptr<Call> call, size_t index) : call_(std::move(call)), index_(index) {}
    void OnTokens(engine::TokenChunk chunk) override {
      absl::MutexLock lock(&call_->mu);
      if (!call_->finished) AppendChunk(chunk, call_->results[index_]);
    }
    void OnDone(const absl::Status& status, const engine::Completion& completion) override {
      Call::Action action;
      {
        absl::MutexLock lock(&call_->mu);
        const absl::Status end = EndStatus(status, completion);
        if (!end.ok()) {
          action = call_->FinishWith(ForPrompt(end, *call_->request, index_));
        } else if (!call_->finished) {
          SetCompletion(completion, call_->results[index_]);
          ++call_->ended;
          action = call_->MaybeAnswer();
        }
      }
      call_->Run(action);
    }

   private:
    const std::shared_ptr<Call> call_;
    const size_t index_;
  };

  // Submits every prompt; the call may be finished before this returns.
  InferReactor(std::shared_ptr<const KServeRequest> request, engine::LlmEngine* engine,
               grpc::CallbackServerContext* context, const ModelInferRequest& proto,
               grpc::ByteBuffer* body)
      : context_(context), call_(std::make_shared<Call>(std::move(request), engine)) {
    const KServeRequest& parsed = *call_->request;
    {
      absl::MutexLock lock(&call_->mu);
      call_->reactor = this;
      call_->response.set_model_name(engine->info().name);
      call_->response.set_model_version(kModelVersion);
      call_->response.set_id(proto.id());
      call_->body = body;
      call_->context = context;
      for (size_t i = 0; i < parsed.num_prompts(); ++i) {
        call_->results.push_back(internal::InitialResult(parsed, i));
      }
    }
    const absl::Time deadline = CallDeadline(*context);
    for (size_t i = 0; i < parsed.num_prompts(); ++i) {
      {
        // Cancelled, or an earlier prompt failed: the rest need not start.
        absl::MutexLock lock(&call_->mu);
        if (call_->finished) return;
      }
      engine::GenerationRequest params = internal::PromptParams(parsed, i);
      params.deadline = deadline;
      absl::StatusOr<uint64_t> id =
          engine->Submit(std::move(params), std::make_shared<Sink>(call_, i));
      Call::Action action;
      {
        absl::MutexLock lock(&call_->mu);
        if (!id.ok()) {
          action = call_->FinishWith(ForPrompt(id.status(), parsed, i));
        } else {
          call_->ids.push_back(*id);
          // Cancelled, or another prompt failed, while this one was submitted.
          if (call_->finished) action.cancel.push_back(*id);
        }
      }
      call_->Run(action);
      if (!id.ok()) return;
    }
    Call::Action action;
    {
      absl::MutexLock lock(&call_->mu);
      call_->all_submitted = true;
      action = call_->MaybeAnswer();
    }
    call_->Run(action);
  }

  void OnCancel() override {
    Call::Action action;
    {
      absl::MutexLock lock(&call_->mu);
      action = call_->FinishWith(absl::CancelledError("the client cancelled the call"));
    }
    // A passed deadline is left to the scheduler, which ends the prompts for
    // it before their next step (counted as a timeout, not a cancel).
    if (DeadlineReached(*context_)) action.cancel.clear();
    call_->Run(action);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&call_->mu);
      call_->reactor = nullptr;
      call_->body = nullptr;
      call_->context = nullptr;
    }
    delete this;
  }

 private:
  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<Call> call_;
};

// ---------------------------------------------------------------------------
// ModelStreamInfer: each request read is a generation; its tokens go out
// through the call's WritePump, so a slow reader gets fewer, larger messages
// rather than an unbounded backlog.

class StreamReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // One request of the stream: its news, written when its turn comes.
  struct Generation : internal::WritePump::Source {
    Generation(std::shared_ptr<const KServeRequest> request, std::string id, std::string model_name)
        : request(std::move(request)), id(std::move(id)), model_name(std::move(model_name)) {}
    const std::shared_ptr<const KServeRequest> request;
    const std::string id;  // the client's, echoed
    const std::string model_name;

    absl::Mutex mu;
    GenerationResult pending ABSL_GUARDED_BY(mu);  // produced and not yet written
    bool done ABSL_GUARDED_BY(mu) = false;
    absl::Status status ABSL_GUARDED_BY(mu);  // the end's (EndStatus)

    // Everything since the last write, as one response.
    std::optional<grpc::ByteBuffer> TakeMessage() override {
      absl::MutexLock lock(&mu);
      ModelStreamInferResponse message;
      ModelInferResponse& response = *message.mutable_infer_response();
      response.set_id(id);
      response.set_model_name(model_name);
      response.set_model_version(kModelVersion);
      if (done && !status.ok()) {
        message.set_error_message(
            absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message()));
        SetFinal(true, response);
        return internal::SerializeBody(message);
      }
      if (!done && (!request->stream || (pending.text.empty() && pending.token_ids.empty()))) {
        return std::nullopt;
      }
      internal::BuildInferResponse(*request, {pending}, done, &response);
      SetFinal(done, response);
      pending = GenerationResult();
      return internal::SerializeBody(message);
    }
  };

  // Shared by the reactor and the sinks.
  struct Call {
    explicit Call(std::shared_ptr<internal::WritePump> pump) : pump(std::move(pump)) {}
    const std::shared_ptr<internal::WritePump> pump;

    absl::Mutex mu;
    engine::LlmEngine* engine ABSL_GUARDED_BY(mu) =
        nullptr;  // the one generations were submitted to
    // Generations not yet ended, by key, with their engine ids once submitted.
    std::map<uint64_t, std::optional<uint64_t>> live ABSL_GUARDED_BY(mu);
    uint64_t next_key ABSL_GUARDED_BY(mu) = 1;
    bool reads_done ABSL_GUARDED_BY(mu) = false;  // the client half-closed (or we stopped reading)
    bool cancelled ABSL_GUARDED_BY(mu) = false;   // client gone or a write failed

    // The call is over once the client half-closed and every generation ended.
    void MaybeFinish() ABSL_LOCKS_EXCLUDED(mu) {
      bool over;
      {
        absl::MutexLock lock(&mu);
        over = reads_done && live.empty();
      }
      if (over) pump->FinishAfterWrites(grpc::Status::OK);
    }

    // Stops every generation (the client is gone).
    void CancelAll() ABSL_LOCKS_EXCLUDED(mu) {
      std::vector<uint64_t> ids;
      engine::LlmEngine* target = nullptr;
      {
        absl::MutexLock lock(&mu);
        if (cancelled) return;
        cancelled = true;
        target = engine;
        for (const auto& [key, id] : live) {
          if (id) ids.push_back(*id);
        }
      }
      for (uint64_t id : ids) target->Cancel(id);
    }

    // An in-band error for the request with `id`; the stream stays open.
    void WriteError(const std::string& id, const absl::Status& status) {
      ModelStreamInferResponse message;
      message.set_error_message(
          absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message()));
      message.mutable_infer_response()->set_id(id);
      SetFinal(true, *message.mutable_infer_response());
      pump->Write(internal::SerializeBody(message));
    }
  };

  class Sink : public engine::RequestSink {
   public:
    Sink(std::shared_ptr<Call> call, std::shared_ptr<Generation> generation, uint64_t key)
        : call_(std::move(call)), generation_(std::move(generation)), key_(key) {}
    void OnTokens(engine::TokenChunk chunk) override {
      {
        absl::MutexLock lock(&generation_->mu);
        AppendChunk(chunk, generation_->pending);
      }
      if (generation_->request->stream) call_->pump->Notify(generation_);
    }
    void OnDone(const absl::Status& status, const engine::Completion& completion) override {
      {
        absl::MutexLock lock(&generation_->mu);
        generation_->done = true;
        generation_->status = ForPrompt(EndStatus(status, completion), *generation_->request, 0);
        SetCompletion(completion, generation_->pending);
      }
      call_->pump->Notify(generation_);
      {
        absl::MutexLock lock(&call_->mu);
        call_->live.erase(key_);
      }
      call_->MaybeFinish();
    }

   private:
    const std::shared_ptr<Call> call_;
    const std::shared_ptr<Generation> generation_;
    const uint64_t key_;
  };

  StreamReactor(ServingState* state, grpc::CallbackServerContext* context)
      : state_(state),
        context_(context),
        call_(std::make_shared<Call>(std::make_shared<internal::WritePump>(
            [this](const grpc::ByteBuffer* message) { StartWrite(message); },
            [this](const grpc::Status& status) { Finish(status); }))) {
    grpc::Status auth = state->Authorize(*context);
    if (!auth.ok()) {
      call_->pump->Abort(auth);
      return;
    }
    StartRead(&body_);
  }

  void OnReadDone(bool ok) override {
    internal::WritePump& pump = *call_->pump;
    if (ok && !pump.ending()) {
      // Held until the next read is issued: no read may start after Finish.
      pump.Hold();
      Handle();
      const bool read_again = !pump.ending();
      if (read_again) StartRead(&body_);
      if (!read_again) StopReading();
      pump.Release();
      return;
    }
    StopReading();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) call_->CancelAll();
    call_->pump->OnWriteDone(ok);
  }

  void OnCancel() override {
    // A passed deadline is left to the scheduler, which ends the generations
    // for it before their next step (counted as a timeout, not a cancel).
    if (!DeadlineReached(*context_)) call_->CancelAll();
    call_->pump->Abort(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was cancelled"));
  }

  void OnDone() override {
    call_->pump->Detach();
    delete this;
  }

 private:
  void StopReading() {
    {
      absl::MutexLock lock(&call_->mu);
      call_->reads_done = true;
    }
    call_->MaybeFinish();
  }

  // Starts the generation the request just read asks for, or writes its error.
  void Handle() {
    ModelInferRequest request;
    const absl::Status body = internal::ParseBody(body_, request);
    if (!body.ok()) {
      if (state_->metrics() != nullptr) state_->metrics()->RequestFailed("invalid");
      call_->WriteError("", body);
      return;
    }
    absl::StatusOr<engine::LlmEngine*> engine = EngineFor(*state_, request);
    absl::StatusOr<KServeRequest> parsed = engine.ok()
                                               ? internal::ParseInferRequest(request)
                                               : absl::StatusOr<KServeRequest>(engine.status());
    if (parsed.ok() && parsed->num_prompts() != 1) {
      parsed = absl::InvalidArgumentError(
          absl::StrCat("ModelStreamInfer takes one prompt per request, got ", parsed->num_prompts(),
                       "; send one request per prompt on the stream"));
    }
    if (!parsed.ok()) {
      call_->WriteError(request.id(), parsed.status());
      return;
    }
    auto generation =
        std::make_shared<Generation>(std::make_shared<const KServeRequest>(*std::move(parsed)),
                                     request.id(), (*engine)->info().name);
    {
      absl::MutexLock lock(&generation->mu);
      generation->pending = internal::InitialResult(*generation->request, 0);
    }
    uint64_t key;
    {
      absl::MutexLock lock(&call_->mu);
      key = call_->next_key++;
      call_->live.emplace(key, std::nullopt);
      call_->engine = *engine;
    }
    engine::GenerationRequest params = internal::PromptParams(*generation->request, 0);
    params.deadline = CallDeadline(*context_);
    // Outside the lock: the scheduler may call the sink (which takes it)
    // before Submit returns.
    absl::StatusOr<uint64_t> id =
        (*engine)->Submit(std::move(params), std::make_shared<Sink>(call_, generation, key));
    bool cancel = false;
    {
      absl::MutexLock lock(&call_->mu);
      if (id.ok()) {
        auto it = call_->live.find(key);
        if (it != call_->live.end()) it->second = *id;
        cancel = call_->cancelled;
      } else {
        call_->live.erase(key);
      }
    }
    if (!id.ok()) {
      call_->WriteError(request.id(), ForPrompt(id.status(), *generation->request, 0));
      return;
    }
    if (cancel) (*engine)->Cancel(*id);
  }

  ServingState* const state_;
  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<Call> call_;
  grpc::ByteBuffer body_;  // the read in flight
};

}  // namespace

KServeService::KServeService(ServingState* state, std::string server_version)
    : state_(state), server_version_(std::move(server_version)) {}

grpc::Status KServeService::AnswerServerLive(grpc::CallbackServerContext* context,
                                             const inference::ServerLiveRequest*,
                                             inference::ServerLiveResponse* response) {
  response->set_live(true);
  return grpc::Status::OK;
}

grpc::Status KServeService::AnswerServerReady(grpc::CallbackServerContext* context,
                                              const inference::ServerReadyRequest*,
                                              inference::ServerReadyResponse* response) {
  response->set_ready(state_->phase() == ServingState::Phase::kReady);
  return grpc::Status::OK;
}

grpc::Status KServeService::AnswerModelReady(grpc::CallbackServerContext* context,
                                             const inference::ModelReadyRequest* request,
                                             inference::ModelReadyResponse* response) {
  grpc::Status status = state_->Authorize(*context);
  if (status.ok()) {
    const engine::LlmEngine* engine = state_->engine();
    // While loading, the served name is not known yet: nothing is ready.
    if (engine != nullptr) {
      status = ToGrpcStatus(CheckModel(*engine, request->name(), request->version()));
    }
    response->set_ready(engine != nullptr && state_->phase() == ServingState::Phase::kReady);
  }
  return status;
}

grpc::Status KServeService::AnswerServerMetadata(grpc::CallbackServerContext* context,
                                                 const inference::ServerMetadataRequest*,
                                                 inference::ServerMetadataResponse* response) {
  grpc::Status status = state_->Authorize(*context);
  if (status.ok()) {
    response->set_name("accel");
    response->set_version(server_version_);
    // Triton's extension names, only for what is really served: request
    // parameters (sampling knobs in ModelInferRequest.parameters).
    response->add_extensions("parameters");
  }
  return status;
}

grpc::Status KServeService::AnswerModelMetadata(grpc::CallbackServerContext* context,
                                                const inference::ModelMetadataRequest* request,
                                                inference::ModelMetadataResponse* response) {
  grpc::Status status = state_->Authorize(*context);
  const engine::LlmEngine* engine = state_->engine();
  if (status.ok() && engine == nullptr) {
    status = ToGrpcStatus(
        absl::UnavailableError("the model is still loading; retry when the server is ready"));
  }
  if (status.ok()) status = ToGrpcStatus(CheckModel(*engine, request->name(), request->version()));
  if (!status.ok()) {
    return status;
  }
  const engine::ModelInfo& info = engine->info();
  response->set_name(info.name);
  response->add_versions(kModelVersion);
  response->set_platform("accel_libtorch");
  const auto add = [](auto* list, const char* name, const char* datatype,
                      const std::vector<int64_t>& shape) {
    auto* tensor = list->Add();
    tensor->set_name(name);
    tensor->set_datatype(datatype);
    for (int64_t d : shape) tensor->add_shape(d);
  };
  // Inputs: a prompt as text or ids; the rest optional (scalar sampling
  // inputs, TensorRT-LLM style; the same names work as request parameters).
  auto* inputs = response->mutable_inputs();
  add(inputs, internal::kTextInput, "BYTES", {-1});
  add(inputs, internal::kInputIds, "INT64", {-1});
  add(inputs, internal::kSamplingParameters, "BYTES", {1});
  add(inputs, "stream", "BOOL", {1});
  add(inputs, "max_tokens", "INT32", {1});
  add(inputs, "temperature", "FP32", {1});
  add(inputs, "top_k", "INT32", {1});
  add(inputs, "top_p", "FP32", {1});
  add(inputs, "min_p", "FP32", {1});
  add(inputs, "repetition_penalty", "FP32", {1});
  add(inputs, "random_seed", "UINT64", {1});
  add(inputs, "stop_words", "BYTES", {-1});
  add(inputs, "ignore_eos", "BOOL", {1});
  add(inputs, "return_logprobs", "BOOL", {1});
  auto* outputs = response->mutable_outputs();
  add(outputs, internal::kTextOutput, "BYTES", {-1});
  add(outputs, internal::kOutputIds, "INT64", {-1});
  add(outputs, internal::kOutputLogProbs, "FP32", {-1});
  add(outputs, internal::kFinishReason, "BYTES", {-1});
  add(outputs, internal::kNumInputTokens, "UINT32", {-1});
  add(outputs, internal::kNumOutputTokens, "UINT32", {-1});
  auto& properties = *response->mutable_properties();
  properties["architecture"] = info.architecture;
  properties["model_type"] = info.model_type;
  properties["dtype"] = info.dtype;
  properties["quantization"] = info.quantization;
  properties["parameters"] = std::to_string(info.parameters);
  properties["max_context"] = std::to_string(info.max_context);
  properties["max_input_tokens"] = std::to_string(info.max_input_tokens);
  properties["max_total_tokens"] = std::to_string(info.max_total_tokens);
  properties["vocab_size"] = std::to_string(info.vocab_size);
  properties["has_tokenizer"] = info.has_tokenizer ? "true" : "false";
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* KServeService::ServerLive(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* body,
                                                    grpc::ByteBuffer* out) {
  return internal::AnswerRaw<inference::ServerLiveRequest, inference::ServerLiveResponse>(
      context, *body, out, [this, context](const auto& request, auto* response) {
        return AnswerServerLive(context, &request, response);
      });
}

grpc::ServerUnaryReactor* KServeService::ServerReady(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* body,
                                                     grpc::ByteBuffer* out) {
  return internal::AnswerRaw<inference::ServerReadyRequest, inference::ServerReadyResponse>(
      context, *body, out, [this, context](const auto& request, auto* response) {
        return AnswerServerReady(context, &request, response);
      });
}

grpc::ServerUnaryReactor* KServeService::ModelReady(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* body,
                                                    grpc::ByteBuffer* out) {
  return internal::AnswerRaw<inference::ModelReadyRequest, inference::ModelReadyResponse>(
      context, *body, out, [this, context](const auto& request, auto* response) {
        return AnswerModelReady(context, &request, response);
      });
}

grpc::ServerUnaryReactor* KServeService::ServerMetadata(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* body,
                                                        grpc::ByteBuffer* out) {
  return internal::AnswerRaw<inference::ServerMetadataRequest, inference::ServerMetadataResponse>(
      context, *body, out, [this, context](const auto& request, auto* response) {
        return AnswerServerMetadata(context, &request, response);
      });
}

grpc::ServerUnaryReactor* KServeService::ModelMetadata(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* body,
                                                       grpc::ByteBuffer* out) {
  return internal::AnswerRaw<inference::ModelMetadataRequest, inference::ModelMetadataResponse>(
      context, *body, out, [this, context](const auto& request, auto* response) {
        return AnswerModelMetadata(context, &request, response);
      });
}

grpc::ServerUnaryReactor* KServeService::ModelInfer(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* body,
                                                    grpc::ByteBuffer* response) {
  const auto fail = [context](const grpc::Status& status) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(status);
    return reactor;
  };
  grpc::Status auth = state_->Authorize(*context);
  if (!auth.ok()) return fail(auth);
  ModelInferRequest request;
  const absl::Status body_status = internal::ParseBody(*body, request);
  if (!body_status.ok()) {
    if (state_->metrics() != nullptr) state_->metrics()->RequestFailed("invalid");
    return fail(ToGrpcStatus(body_status));
  }
  absl::StatusOr<engine::LlmEngine*> engine = EngineFor(*state_, request);
  if (!engine.ok()) return fail(ToGrpcStatus(engine.status()));
  absl::StatusOr<KServeRequest> parsed = internal::ParseInferRequest(request);
  if (!parsed.ok()) return fail(ToGrpcStatus(parsed.status()));
  if (parsed->stream) {
    // Triton answers the same for a decoupled model on the unary RPC.
    return fail(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                             "stream=true needs ModelStreamInfer; ModelInfer answers once"));
  }
  return new InferReactor(std::make_shared<const KServeRequest>(*std::move(parsed)), *engine,
                          context, request, response);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KServeService::ModelStreamInfer(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(state_, context);
}

}  // namespace accel::server
