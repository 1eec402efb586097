#include "server/generation_service.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#include "core/json.h"
#include "core/status.h"
#include "engine/llm_engine.h"
#include "grammar/tool_calls.h"
#include "server/internal/openai_convert.h"
#include "server/internal/wire.h"
#include "server/internal/write_pump.h"
#include "server/server_metrics.h"
#include "tokenizer/tokenizer.h"

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
// A stream's tool-call parser for one choice, and the call it is writing
// (sent once it ends).
struct ToolStream {
  std::unique_ptr<grammar::ToolCallStreamParser> parser;
  std::optional<grammar::ToolCall> pending;
};

// What the call's sink needs of the request: its choices and Chat's tool
// settings (applied once the engine, and so the model's tool-call syntax, is
// known). Set before the request is submitted, read only after; the
// streams are used on the engine's thread alone: no lock.
struct CallSettings {
  int64_t n = 1;         // choices (GenerateRequest.n, ChatRequest.n)
  std::string choice;    // "" / auto, none, required
  std::string function;  // tool_choice_function
  std::string tools_json;
  grammar::ToolCallFormat format = grammar::ToolCallFormat::kNone;  // kNone: no parsing
  bool stream = false;
  std::map<int64_t, ToolStream> streams;  // a stream's, by choice

  // Choice `index`'s parser in a stream that parses tool calls; null otherwise.
  ToolStream* StreamFor(int64_t index) {
    if (!stream || format == grammar::ToolCallFormat::kNone) return nullptr;
    ToolStream& s = streams[index];
    if (s.parser == nullptr) s.parser = std::make_unique<grammar::ToolCallStreamParser>(format);
    return &s;
  }
};

absl::StatusOr<engine::GenerationRequest> ChatToParams(const ChatRequest& request,
                                                       const grpc::ServerContextBase& context,
                                                       CallSettings* chat_tools) {
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
  const std::string& choice = request.tool_choice();
  if (!choice.empty() && choice != "auto" && choice != "none" && choice != "required") {
    return absl::InvalidArgumentError(absl::StrCat(
        "tool_choice: expected auto, none or required, got \"", choice.substr(0, 32), "\""));
  }
  if ((choice == "required" || !request.tool_choice_function().empty()) && tools.empty()) {
    return absl::InvalidArgumentError("tool_choice: a forced call needs tools_json");
  }
  if (chat_tools != nullptr && !tools.empty()) {
    chat_tools->choice = choice;
    chat_tools->function = request.tool_choice_function();
    chat_tools->tools_json = tools.dump(-1, ' ', false, Json::error_handler_t::replace);
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
  params.min_tokens = request.min_tokens();
  params.include_stop_str_in_output = request.include_stop_str_in_output();
  params.logprobs = request.return_logprobs();
  params.structured = ToStructured(request.structured_output());
  params.n = request.n() == 0 ? 1 : request.n();
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
  params.min_tokens = request.min_tokens();
  params.include_stop_str_in_output = request.include_stop_str_in_output();
  params.logprobs = request.return_logprobs();
  params.structured = ToStructured(request.structured_output());
  params.n = request.n() == 0 ? 1 : request.n();
  params.deadline = CallDeadline(context);
  return params;
}

template <typename Message>  // GenerateResponse or Choice
void AppendChunk(const engine::TokenChunk& chunk, Message& out) {
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
                                                      const grpc::ServerContextBase& context,
                                                      CallSettings* chat_tools) {
  if (method == Method::kChat) {
    ChatRequest request;
    ACCEL_RETURN_IF_ERROR(internal::ParseBody(body, request));
    return ChatToParams(request, context, chat_tools);
  }
  GenerateRequest request;
  ACCEL_RETURN_IF_ERROR(internal::ParseBody(body, request));
  return ToParams(request, context);
}

// Chat with tools: the model's call syntax (--tool_call_parser, or auto
// from its vocabulary) and, for a forced call, the grammar of one.
absl::Status ApplyChatTools(const std::string& tool_call_parser, const engine::LlmEngine& engine,
                            bool stream, engine::GenerationRequest& params, CallSettings& tools) {
  if (tools.tools_json.empty() || tools.choice == "none") return absl::OkStatus();
  grammar::ToolCallFormat format = grammar::ToolCallFormat::kNone;
  if (tool_call_parser == "auto") {
    const tokenizer::Tokenizer* tok = engine.tokenizer();
    format = grammar::ToolCallFormatFromVocabulary([tok](absl::string_view token) {
      return tok != nullptr && tok->TokenToId(token).has_value();
    });
  } else {
    format = grammar::ToolCallFormatFromName(tool_call_parser).value_or(format);
  }
  const bool forced = tools.choice == "required" || !tools.function.empty();
  if (forced) {
    if (format == grammar::ToolCallFormat::kNone) {
      return absl::InvalidArgumentError(
          "tool_choice: a forced call needs the server's --tool_call_parser (hermes, "
          "llama3_json or mistral; auto found none for this model)");
    }
    if (params.structured) {
      return absl::InvalidArgumentError(
          "tool_choice: a forced call cannot be combined with structured_output");
    }
    std::optional<std::string> name;
    if (!tools.function.empty()) name = tools.function;
    absl::StatusOr<std::string> gbnf = grammar::ToolCallGbnf(format, tools.tools_json, name);
    if (!gbnf.ok()) {
      // This wire's field names.
      std::string message(gbnf.status().message());
      if (name && absl::StartsWith(message, "tool_choice: no function named")) {
        message =
            absl::StrCat("tool_choice_function", message.substr(std::string("tool_choice").size()));
      } else if (!absl::StartsWith(message, "tool_choice")) {
        message = absl::StrCat("tools_json: ", message);
      }
      return absl::InvalidArgumentError(message);
    }
    engine::StructuredOutputs structured;
    structured.grammar = *std::move(gbnf);
    structured.field = "tool_choice";
    params.structured = std::move(structured);
  }
  tools.format = format;
  tools.stream = stream;
  return absl::OkStatus();
}

// The stream parser's events into `out`: content into text, each call whole
// once the next begins (the last by FlushToolCall).
template <typename Message>  // GenerateResponse or Choice
void AddToolEvents(std::vector<grammar::ToolCallStreamParser::Event> events, ToolStream& tools,
                   Message& out) {
  for (auto& e : events) {
    out.mutable_text()->append(e.content);
    if (e.call) {
      if (tools.pending) {
        accel::v1::ToolCall* call = out.add_tool_calls();
        call->set_id(tools.pending->id);
        call->set_type("function");
        call->set_name(tools.pending->name);
        call->set_arguments_json(tools.pending->arguments);
      }
      tools.pending = *std::move(e.call);
    }
    if (!e.arguments.empty() && tools.pending) tools.pending->arguments += e.arguments;
  }
}

template <typename Message>
void FlushToolCall(ToolStream& tools, Message& out) {
  if (!tools.pending) return;
  accel::v1::ToolCall* call = out.add_tool_calls();
  call->set_id(tools.pending->id);
  call->set_type("function");
  call->set_name(tools.pending->name);
  call->set_arguments_json(tools.pending->arguments);
  tools.pending.reset();
}

// A finished unary answer (or one choice of it): the calls parsed out of
// its text, which keeps the content before them.
template <typename Message>
void ParseToolCallsInto(grammar::ToolCallFormat format, Message& out) {
  if (format == grammar::ToolCallFormat::kNone) return;
  grammar::ParsedToolCalls parsed = grammar::ParseToolCalls(format, out.text());
  if (parsed.calls.empty()) return;
  out.set_text(parsed.content);
  for (const grammar::ToolCall& c : parsed.calls) {
    accel::v1::ToolCall* call = out.add_tool_calls();
    call->set_id(c.id);
    call->set_type("function");
    call->set_name(c.name);
    call->set_arguments_json(c.arguments);
  }
}

grpc::Status Start(Method method, ServingState& state, grpc::CallbackServerContext& context,
                   const grpc::ByteBuffer& body, std::shared_ptr<engine::RequestSink> sink,
                   CallState& call, const std::string& tool_call_parser, CallSettings& tools,
                   bool stream) {
  grpc::Status auth = state.Authorize(context);
  if (!auth.ok()) return auth;
  absl::StatusOr<engine::GenerationRequest> params = ParseParams(method, body, context, &tools);
  if (!params.ok()) {
    if (state.metrics() != nullptr) {
      // A call whose deadline passed (or that was cancelled) while its
      // request was still arriving is refused for that, whatever the partial
      // request's own fault: counted as its deadline or cancel, not invalid.
      const absl::Status wanted = CallStillWanted(context);
      const absl::StatusCode code = wanted.ok() ? params.status().code() : wanted.code();
      state.metrics()->RequestFailed(code == absl::StatusCode::kDeadlineExceeded ? "timeout"
                                     : code == absl::StatusCode::kCancelled      ? "cancelled"
                                                                                 : "invalid");
    }
    return ToGrpcStatus(params.status());
  }
  tools.n = params->n;
  absl::StatusOr<engine::LlmEngine*> engine = state.ReadyEngine();
  if (!engine.ok()) return ToGrpcStatus(engine.status());
  if (absl::Status applied = ApplyChatTools(tool_call_parser, **engine, stream, *params, tools);
      !applied.ok()) {
    if (state.metrics() != nullptr) state.metrics()->RequestFailed("invalid");
    return ToGrpcStatus(applied);
  }
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
    std::map<int64_t, accel::v1::Choice> choices ABSL_GUARDED_BY(mu);  // n > 1
    grpc::ByteBuffer* body ABSL_GUARDED_BY(mu) = nullptr;  // gRPC's, where the answer goes
  };

  class Sink : public engine::RequestSink {
   public:
    Sink(std::shared_ptr<Call> call, std::shared_ptr<CallSettings> settings)
        : call_(std::move(call)), settings_(std::move(settings)) {}
    void OnTokens(engine::TokenChunk chunk) override {
      absl::MutexLock lock(&call_->mu);
      if (settings_->n == 1) {
        AppendChunk(chunk, call_->response);
        return;
      }
      accel::v1::Choice& choice = call_->choices[chunk.index];
      AppendChunk(chunk, choice);
      if (chunk.finish) choice.set_finish_reason(ToProto(*chunk.finish));
    }
    void OnDone(const absl::Status& status, const engine::Completion& completion) override {
      GenerateReactor* reactor = nullptr;
      {
        absl::MutexLock lock(&call_->mu);
        if (call_->reactor == nullptr) return;
        if (status.ok()) {
          GenerateResponse& response = call_->response;
          SetCompletion(completion, response);
          if (settings_->n == 1) {
            ParseToolCallsInto(settings_->format, response);
          } else {
            // Every choice, in order; the top-level fields are choice 0's.
            for (int64_t i = 0; i < settings_->n; ++i) {
              accel::v1::Choice& choice = call_->choices[i];
              choice.set_index(static_cast<int32_t>(i));
              ParseToolCallsInto(settings_->format, choice);
              *response.add_choices() = choice;
            }
            const accel::v1::Choice& first = response.choices(0);
            *response.mutable_token_ids() = first.token_ids();
            response.set_text(first.text());
            *response.mutable_logprobs() = first.logprobs();
            response.set_finish_reason(first.finish_reason());
            *response.mutable_tool_calls() = first.tool_calls();
          }
          *call_->body = internal::SerializeBody(response);
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
    const std::shared_ptr<CallSettings> settings_;
  };

  GenerateReactor(Method method, ServingState* state, const std::string& tool_call_parser,
                  grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                  grpc::ByteBuffer* response)
      : context_(context), call_(std::make_shared<Call>()) {
    {
      absl::MutexLock lock(&call_->mu);
      call_->reactor = this;
      call_->body = response;
    }
    auto settings = std::make_shared<CallSettings>();
    grpc::Status started =
        Start(method, *state, *context, *request, std::make_shared<Sink>(call_, settings), *call_,
              tool_call_parser, *settings, /*stream=*/false);
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
    Sink(std::shared_ptr<internal::WritePump> pump, std::shared_ptr<CallSettings> settings)
        : pump_(std::move(pump)), settings_(std::move(settings)) {}
    void OnTokens(engine::TokenChunk chunk) override {
      const int64_t index = settings_->n == 1 ? 0 : chunk.index;
      const std::shared_ptr<News>& news = NewsFor(index);
      {
        absl::MutexLock lock(&news->mu);
        if (!news->next) {
          news->next.emplace();
          news->next->set_index(static_cast<int32_t>(index));
        }
        if (ToolStream* parsing = settings_->StreamFor(index)) {
          // The text goes through the tool-call parser: content stays text.
          std::string text = std::move(chunk.text);
          chunk.text.clear();
          AppendChunk(chunk, *news->next);
          AddToolEvents(parsing->parser->Add(text), *parsing, *news->next);
          if (chunk.finish) {
            AddToolEvents(parsing->parser->Finish(), *parsing, *news->next);
            FlushToolCall(*parsing, *news->next);
          }
        } else {
          AppendChunk(chunk, *news->next);
        }
        // n > 1: this choice's end.
        if (chunk.finish) news->next->set_finish_reason(ToProto(*chunk.finish));
      }
      pump_->Notify(news);
    }
    void OnDone(const absl::Status& status, const engine::Completion& completion) override {
      if (status.ok()) {
        // One choice: its last message. n > 1: a message of its own after
        // every choice's (each choice ended with its own finish_reason).
        const std::shared_ptr<News>& news = NewsFor(settings_->n == 1 ? 0 : -1);
        {
          absl::MutexLock lock(&news->mu);
          if (!news->next) news->next.emplace();
          if (settings_->n == 1) {
            if (ToolStream* parsing = settings_->StreamFor(0)) {
              AddToolEvents(parsing->parser->Finish(), *parsing, *news->next);
              FlushToolCall(*parsing, *news->next);
            }
          }
          SetCompletion(completion, *news->next);
          if (settings_->n > 1) news->next->clear_finish_reason();
        }
        pump_->Notify(news);
      }
      pump_->FinishAfterWrites(ToGrpcStatus(status));
    }

   private:
    // Each choice is a source of its own, so that one message never mixes
    // two choices' tokens (the pump writes each source's news as one).
    const std::shared_ptr<News>& NewsFor(int64_t index) {
      absl::MutexLock lock(&mu_);
      std::shared_ptr<News>& news = news_[index];
      if (news == nullptr) news = std::make_shared<News>();
      return news;
    }

    const std::shared_ptr<internal::WritePump> pump_;
    const std::shared_ptr<CallSettings> settings_;
    absl::Mutex mu_;
    std::map<int64_t, std::shared_ptr<News>> news_ ABSL_GUARDED_BY(mu_);
  };

  StreamReactor(Method method, ServingState* state, const std::string& tool_call_parser,
                grpc::CallbackServerContext* context, const grpc::ByteBuffer* request)
      : context_(context),
        pump_(std::make_shared<internal::WritePump>(
            [this](const grpc::ByteBuffer* message) { StartWrite(message); },
            [this](const grpc::Status& status) { Finish(status); })) {
    auto settings = std::make_shared<CallSettings>();
    grpc::Status started =
        Start(method, *state, *context, *request, std::make_shared<Sink>(pump_, settings), call_,
              tool_call_parser, *settings, /*stream=*/true);
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
  return new GenerateReactor(Method::kGenerate, state_, tool_call_parser_, context, request,
                             response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerationService::GenerateStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new StreamReactor(Method::kGenerate, state_, tool_call_parser_, context, request);
}

grpc::ServerUnaryReactor* GenerationService::Chat(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) {
  return new GenerateReactor(Method::kChat, state_, tool_call_parser_, context, request, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerationService::ChatStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new StreamReactor(Method::kChat, state_, tool_call_parser_, context, request);
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
