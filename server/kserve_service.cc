#include "server/kserve_service.h"

#include <cstdint>
#include <deque>
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
#include "server/engine.h"
#include "server/internal/kserve_convert.h"
#include "server/scheduler.h"

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
absl::Status CheckModel(const Engine& engine, const std::string& name, const std::string& version) {
  const std::string& served = engine.info().name;
  if (!name.empty() && name != served) {
    return absl::NotFoundError(absl::StrCat(
        "model \"", name, "\" is not served here; this server serves \"", served, "\""));
  }
  if (!version.empty() && version != kModelVersion) {
    return absl::NotFoundError(absl::StrCat("model \"", served, "\" has no version \"", version,
                                            "\"; its only version is \"", kModelVersion, "\""));
  }
  return absl::OkStatus();
}

// The engine to run `request` on, or the status to answer with.
absl::StatusOr<Engine*> EngineFor(const ServingState& state, const ModelInferRequest& request) {
  absl::StatusOr<Engine*> engine = state.ReadyEngine();
  if (!engine.ok()) return engine.status();
  ACCEL_RETURN_IF_ERROR(CheckModel(**engine, request.model_name(), request.model_version()));
  return engine;
}

// How a prompt's end reads as a status: the sink's, or for a request the
// server itself stopped (a drain past its grace period), Unavailable, so
// the client retries elsewhere rather than take a cut-short answer as whole.
absl::Status EndStatus(const absl::Status& status, const Completion& completion) {
  if (!status.ok()) return status;
  if (completion.finish == Finish::kCancelled) {
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

void AppendChunk(const TokenChunk& chunk, GenerationResult& result) {
  result.text += chunk.text;
  result.token_ids.insert(result.token_ids.end(), chunk.token_ids.begin(), chunk.token_ids.end());
  result.logprobs.insert(result.logprobs.end(), chunk.logprobs.begin(), chunk.logprobs.end());
}

void SetCompletion(const Completion& completion, GenerationResult& result) {
  result.finish_reason = FinishName(completion.finish);
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
    Call(std::shared_ptr<const KServeRequest> request, Engine* engine)
        : request(std::move(request)), engine(engine) {}
    const std::shared_ptr<const KServeRequest> request;
    Engine* const engine;

    absl::Mutex mu;
    InferReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;  // null once OnDone ran
    ModelInferResponse* response ABSL_GUARDED_BY(mu) = nullptr;
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
      internal::BuildInferResponse(*request, results, /*final=*/true, response);
      return FinishWith(absl::OkStatus());
    }

    void Run(const Action& action) {
      for (uint64_t id : action.cancel) engine->Cancel(id);
      if (action.reactor != nullptr) action.reactor->Finish(action.status);
    }
  };

  class Sink : public RequestSink {
   public:
    Sink(std::shared_ptr<Call> call, size_t index) : call_(std::move(call)), index_(index) {}
    void OnTokens(TokenChunk chunk) override {
      absl::MutexLock lock(&call_->mu);
      if (!call_->finished) AppendChunk(chunk, call_->results[index_]);
    }
    void OnDone(const absl::Status& status, const Completion& completion) override {
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
  InferReactor(std::shared_ptr<const KServeRequest> request, Engine* engine,
               grpc::CallbackServerContext* context, const ModelInferRequest& proto,
               ModelInferResponse* response)
      : call_(std::make_shared<Call>(std::move(request), engine)) {
    const KServeRequest& parsed = *call_->request;
    response->set_model_name(engine->info().name);
    response->set_model_version(kModelVersion);
    response->set_id(proto.id());
    {
      absl::MutexLock lock(&call_->mu);
      call_->reactor = this;
      call_->response = response;
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
      models::GenerationRequest params = internal::PromptParams(parsed, i);
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
    call_->Run(action);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&call_->mu);
      call_->reactor = nullptr;
      call_->response = nullptr;
      call_->context = nullptr;
    }
    delete this;
  }

 private:
  const std::shared_ptr<Call> call_;
};

// ---------------------------------------------------------------------------
// ModelStreamInfer: each request read is a generation; its tokens go out as
// responses, one write in flight at a time. A generation with news waits in
// `queue` once; when its turn comes, everything it produced meanwhile goes
// out as one response, so a slow reader gets fewer, larger messages rather
// than an unbounded backlog.

class StreamReactor : public grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse> {
 public:
  // Guarded by Call::mu (a sink and the reactor share it).
  struct Generation {
    std::shared_ptr<const KServeRequest> request;
    std::string id;  // the client's, echoed
    std::string model_name;
    uint64_t key = 0;                   // in Call::live
    std::optional<uint64_t> engine_id;  // once submitted
    GenerationResult pending;           // produced and not yet written
    bool done = false;
    absl::Status status;  // the end's (EndStatus)
    bool queued = false;
  };

  // One thing to write: a generation's news, or a ready message (an error).
  struct Outbound {
    std::shared_ptr<Generation> generation;
    std::optional<ModelStreamInferResponse> message;
  };

  struct Call {
    absl::Mutex mu;
    StreamReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;  // null once OnDone ran
    Engine* engine ABSL_GUARDED_BY(mu) = nullptr;          // the one generations were submitted to
    std::map<uint64_t, std::shared_ptr<Generation>> live ABSL_GUARDED_BY(mu);
    uint64_t next_key ABSL_GUARDED_BY(mu) = 1;
    std::deque<Outbound> queue ABSL_GUARDED_BY(mu);
    ModelStreamInferResponse in_flight ABSL_GUARDED_BY(mu);  // must outlive its write
    bool writing ABSL_GUARDED_BY(mu) = false;
    // In OnReadDone until its next StartRead is issued: no Finish then, since
    // a read must not start after Finish.
    bool in_read ABSL_GUARDED_BY(mu) = false;
    bool reads_done ABSL_GUARDED_BY(mu) = false;            // the client half-closed
    bool cancelled ABSL_GUARDED_BY(mu) = false;             // client gone or a write failed
    std::optional<grpc::Status> abort ABSL_GUARDED_BY(mu);  // finish with this at once
    bool finished ABSL_GUARDED_BY(mu) = false;

    // What to do once the lock is released: gRPC may run reactions that
    // take it on the thread that calls StartWrite or Finish.
    struct Action {
      StreamReactor* reactor = nullptr;
      const ModelStreamInferResponse* write = nullptr;
      std::optional<grpc::Status> finish;
      std::vector<uint64_t> cancel;
      Engine* engine = nullptr;
    };

    void Run(const Action& action) {
      for (uint64_t id : action.cancel) action.engine->Cancel(id);
      if (action.write != nullptr) action.reactor->StartWrite(action.write);
      if (action.finish) action.reactor->Finish(*action.finish);
    }

    // Stops every generation (the client is gone).
    void CancelAll(Action& action) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      cancelled = true;
      action.engine = engine;
      for (const auto& [key, generation] : live) {
        if (generation->engine_id) action.cancel.push_back(*generation->engine_id);
      }
    }

    // Moves `generation`'s news into `in_flight`; false when there is none.
    bool TakeNews(Generation& generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      in_flight.Clear();
      ModelInferResponse& response = *in_flight.mutable_infer_response();
      response.set_id(generation.id);
      response.set_model_name(generation.model_name);
      response.set_model_version(kModelVersion);
      const KServeRequest& request = *generation.request;
      if (generation.done && !generation.status.ok()) {
        in_flight.set_error_message(absl::StrCat(absl::StatusCodeToString(generation.status.code()),
                                                 ": ", generation.status.message()));
        SetFinal(true, response);
        return true;
      }
      if (!generation.done) {
        const GenerationResult& p = generation.pending;
        if (!request.stream || (p.text.empty() && p.token_ids.empty())) return false;
      }
      internal::BuildInferResponse(request, {generation.pending}, generation.done, &response);
      SetFinal(generation.done, response);
      generation.pending = GenerationResult();
      return true;
    }

    // Adds the next write, or the Finish once nothing is left to do.
    void Pump(Action& action) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      if (reactor == nullptr || finished || writing) return;
      action.reactor = reactor;
      if (!cancelled && !abort) {
        while (!queue.empty()) {
          Outbound next = std::move(queue.front());
          queue.pop_front();
          if (next.message) {
            in_flight = *std::move(next.message);
          } else {
            Generation& generation = *next.generation;
            generation.queued = false;
            if (!TakeNews(generation)) continue;
            if (generation.done) live.erase(generation.key);
          }
          writing = true;
          action.write = &in_flight;
          return;
        }
      }
      if (in_read) return;
      if (cancelled) {
        finished = true;
        action.finish = grpc::Status(grpc::StatusCode::CANCELLED, "the stream was cancelled");
      } else if (abort) {
        finished = true;
        action.finish = *abort;
      } else if (reads_done && live.empty()) {
        finished = true;
        action.finish = grpc::Status::OK;
      }
    }

    void Enqueue(const std::shared_ptr<Generation>& generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      if (generation->queued) return;
      generation->queued = true;
      queue.push_back({generation, std::nullopt});
    }

    // An in-band error for the request with `id`; the stream stays open.
    void EnqueueError(const std::string& id, const absl::Status& status)
        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      ModelStreamInferResponse message;
      message.set_error_message(
          absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message()));
      message.mutable_infer_response()->set_id(id);
      SetFinal(true, *message.mutable_infer_response());
      queue.push_back({nullptr, std::move(message)});
    }
  };

  class Sink : public RequestSink {
   public:
    Sink(std::shared_ptr<Call> call, std::shared_ptr<Generation> generation)
        : call_(std::move(call)), generation_(std::move(generation)) {}
    void OnTokens(TokenChunk chunk) override {
      Call::Action action;
      {
        absl::MutexLock lock(&call_->mu);
        if (call_->finished) return;
        AppendChunk(chunk, generation_->pending);
        if (generation_->request->stream) call_->Enqueue(generation_);
        call_->Pump(action);
      }
      call_->Run(action);
    }
    void OnDone(const absl::Status& status, const Completion& completion) override {
      Call::Action action;
      {
        absl::MutexLock lock(&call_->mu);
        if (call_->finished) return;
        generation_->done = true;
        generation_->status = ForPrompt(EndStatus(status, completion), *generation_->request, 0);
        SetCompletion(completion, generation_->pending);
        call_->Enqueue(generation_);
        call_->Pump(action);
      }
      call_->Run(action);
    }

   private:
    const std::shared_ptr<Call> call_;
    const std::shared_ptr<Generation> generation_;
  };

  StreamReactor(ServingState* state, grpc::CallbackServerContext* context)
      : state_(state), context_(context), call_(std::make_shared<Call>()) {
    grpc::Status auth = state->Authorize(*context);
    Call::Action action;
    {
      absl::MutexLock lock(&call_->mu);
      call_->reactor = this;
      if (!auth.ok()) {
        call_->abort = auth;
        call_->Pump(action);
      }
    }
    if (!auth.ok()) {
      call_->Run(action);
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    Call::Action action;
    bool handle = false;
    {
      absl::MutexLock lock(&call_->mu);
      if (ok && !call_->finished && !call_->cancelled) {
        call_->in_read = true;
        handle = true;
      } else {
        call_->reads_done = true;
        call_->Pump(action);
      }
    }
    if (!handle) {
      call_->Run(action);
      return;
    }
    Handle(request_);
    bool read_again;
    {
      absl::MutexLock lock(&call_->mu);
      read_again = !call_->finished && !call_->cancelled;
    }
    // in_read holds off Finish until this read is issued.
    if (read_again) StartRead(&request_);
    {
      absl::MutexLock lock(&call_->mu);
      call_->in_read = false;
      if (!read_again) call_->reads_done = true;
      call_->Pump(action);
    }
    call_->Run(action);
  }

  void OnWriteDone(bool ok) override {
    Call::Action action;
    {
      absl::MutexLock lock(&call_->mu);
      call_->writing = false;
      if (!ok && !call_->cancelled) call_->CancelAll(action);
      call_->Pump(action);
    }
    call_->Run(action);
  }

  void OnCancel() override {
    Call::Action action;
    {
      absl::MutexLock lock(&call_->mu);
      if (!call_->cancelled) call_->CancelAll(action);
      call_->Pump(action);
    }
    call_->Run(action);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&call_->mu);
      call_->reactor = nullptr;
    }
    delete this;
  }

 private:
  // Starts the generation `request` asks for, or queues its error.
  void Handle(const ModelInferRequest& request) {
    absl::StatusOr<Engine*> engine = EngineFor(*state_, request);
    absl::StatusOr<KServeRequest> parsed = engine.ok()
                                               ? internal::ParseInferRequest(request)
                                               : absl::StatusOr<KServeRequest>(engine.status());
    if (parsed.ok() && parsed->num_prompts() != 1) {
      parsed = absl::InvalidArgumentError(
          absl::StrCat("ModelStreamInfer takes one prompt per request, got ", parsed->num_prompts(),
                       "; send one request per prompt on the stream"));
    }
    if (!parsed.ok()) {
      absl::MutexLock lock(&call_->mu);
      call_->EnqueueError(request.id(), parsed.status());
      return;
    }
    auto generation = std::make_shared<Generation>();
    generation->request = std::make_shared<const KServeRequest>(*std::move(parsed));
    generation->id = request.id();
    generation->model_name = (*engine)->info().name;
    generation->pending = internal::InitialResult(*generation->request, 0);
    {
      absl::MutexLock lock(&call_->mu);
      generation->key = call_->next_key++;
      call_->live.emplace(generation->key, generation);
      call_->engine = *engine;
    }
    models::GenerationRequest params = internal::PromptParams(*generation->request, 0);
    params.deadline = CallDeadline(*context_);
    // Outside the lock: the scheduler may call the sink (which takes it)
    // before Submit returns.
    absl::StatusOr<uint64_t> id =
        (*engine)->Submit(std::move(params), std::make_shared<Sink>(call_, generation));
    bool cancel = false;
    {
      absl::MutexLock lock(&call_->mu);
      if (!id.ok()) {
        call_->live.erase(generation->key);
        call_->EnqueueError(request.id(), ForPrompt(id.status(), *generation->request, 0));
        return;
      }
      generation->engine_id = *id;
      cancel = call_->cancelled;
    }
    if (cancel) (*engine)->Cancel(*id);
  }

  ServingState* const state_;
  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<Call> call_;
  ModelInferRequest request_;  // the read in flight
};

}  // namespace

KServeService::KServeService(ServingState* state, std::string server_version)
    : state_(state), server_version_(std::move(server_version)) {}

grpc::ServerUnaryReactor* KServeService::ServerLive(grpc::CallbackServerContext* context,
                                                    const inference::ServerLiveRequest*,
                                                    inference::ServerLiveResponse* response) {
  response->set_live(true);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* KServeService::ServerReady(grpc::CallbackServerContext* context,
                                                     const inference::ServerReadyRequest*,
                                                     inference::ServerReadyResponse* response) {
  response->set_ready(state_->phase() == ServingState::Phase::kReady);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* KServeService::ModelReady(grpc::CallbackServerContext* context,
                                                    const inference::ModelReadyRequest* request,
                                                    inference::ModelReadyResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status status = state_->Authorize(*context);
  if (status.ok()) {
    const Engine* engine = state_->engine();
    // While loading, the served name is not known yet: nothing is ready.
    if (engine != nullptr) {
      status = ToGrpcStatus(CheckModel(*engine, request->name(), request->version()));
    }
    response->set_ready(engine != nullptr && state_->phase() == ServingState::Phase::kReady);
  }
  reactor->Finish(status);
  return reactor;
}

grpc::ServerUnaryReactor* KServeService::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status status = state_->Authorize(*context);
  if (status.ok()) {
    response->set_name("accel");
    response->set_version(server_version_);
    // Triton's extension names, only for what is really served: request
    // parameters (sampling knobs in ModelInferRequest.parameters).
    response->add_extensions("parameters");
  }
  reactor->Finish(status);
  return reactor;
}

grpc::ServerUnaryReactor* KServeService::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status status = state_->Authorize(*context);
  const Engine* engine = state_->engine();
  if (status.ok() && engine == nullptr) {
    status = ToGrpcStatus(
        absl::UnavailableError("the model is still loading; retry when the server is ready"));
  }
  if (status.ok()) status = ToGrpcStatus(CheckModel(*engine, request->name(), request->version()));
  if (!status.ok()) {
    reactor->Finish(status);
    return reactor;
  }
  const ModelInfo& info = engine->info();
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
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* KServeService::ModelInfer(grpc::CallbackServerContext* context,
                                                    const ModelInferRequest* request,
                                                    ModelInferResponse* response) {
  const auto fail = [context](const grpc::Status& status) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(status);
    return reactor;
  };
  grpc::Status auth = state_->Authorize(*context);
  if (!auth.ok()) return fail(auth);
  absl::StatusOr<Engine*> engine = EngineFor(*state_, *request);
  if (!engine.ok()) return fail(ToGrpcStatus(engine.status()));
  absl::StatusOr<KServeRequest> parsed = internal::ParseInferRequest(*request);
  if (!parsed.ok()) return fail(ToGrpcStatus(parsed.status()));
  if (parsed->stream) {
    // Triton answers the same for a decoupled model on the unary RPC.
    return fail(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                             "stream=true needs ModelStreamInfer; ModelInfer answers once"));
  }
  return new InferReactor(std::make_shared<const KServeRequest>(*std::move(parsed)), *engine,
                          context, *request, response);
}

grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse>*
KServeService::ModelStreamInfer(grpc::CallbackServerContext* context) {
  return new StreamReactor(state_, context);
}

}  // namespace accel::server
