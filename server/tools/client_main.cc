// accel-client: a small command-line client of accel-serve, for people and
// for probes (Docker HEALTHCHECK, scripts).
//
//   accel-client generate --prompt "Once upon a time" --max_new_tokens 32 [--stream]
//   accel-client chat --prompt "Hello!" [--system "Be brief."] [--messages chat.json] [--stream]
//   accel-client info
//   accel-client health [--service accel.ready]   # exit 0 when SERVING
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "accel/v1/generation.grpc.pb.h"
#include "core/json.h"
#include "core/tool_main.h"
#include "grpc/health/v1/health.grpc.pb.h"

ABSL_FLAG(std::string, address, "localhost:50051", "accel-serve's gRPC address (host:port).");
ABSL_FLAG(std::string, prompt, "", "generate: the prompt text; chat: the user's message.");
ABSL_FLAG(std::string, system, "", "chat: a system message first.");
ABSL_FLAG(std::string, messages, "",
          "chat: a JSON file of earlier messages ([{\"role\": ..., \"content\": ...}, ...]); "
          "--prompt, if given, is appended as the user's message.");
ABSL_FLAG(int64_t, max_new_tokens, 0,
          "generate: tokens to generate at most; 0: the server's default.");
ABSL_FLAG(double, temperature, 0.0, "generate: 0 is greedy.");
ABSL_FLAG(int64_t, top_k, 0, "generate: 0 is off.");
ABSL_FLAG(double, top_p, 1.0, "generate: 1 is off.");
ABSL_FLAG(int64_t, seed, -1, "generate: the sampling seed; -1: random.");
ABSL_FLAG(std::vector<std::string>, stop, {}, "generate: stop strings, comma-separated.");
ABSL_FLAG(bool, stream, false, "generate: print the text as it is produced.");
ABSL_FLAG(std::string, service, "accel.ready",
          "health: the service name to check (\"\" or accel.live: the process; accel.ready: "
          "the model serves).");
ABSL_FLAG(std::string, token_file, "", "A file with the bearer token (--auth_token_file).");
ABSL_FLAG(std::string, tls_ca, "", "PEM root certificate: connect over TLS, trusting it.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(60), "Deadline of the call.");

namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "accel-client: %s\n", message.c_str());
  return 1;
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream text;
  text << in.rdbuf();
  *out = text.str();
  return true;
}

// Sets the deadline and the bearer token on a call.
bool Prepare(grpc::ClientContext& context, std::string* error) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (token_file.empty()) return true;
  std::string token;
  if (!ReadFile(token_file, &token)) {
    *error = "--token_file: cannot read " + token_file;
    return false;
  }
  context.AddMetadata("authorization", absl::StrCat("Bearer ", absl::StripAsciiWhitespace(token)));
  return true;
}

const char* FinishName(accel::v1::FinishReason reason) {
  switch (reason) {
    case accel::v1::FINISH_REASON_LENGTH:
      return "length";
    case accel::v1::FINISH_REASON_EOS:
      return "eos";
    case accel::v1::FINISH_REASON_STOP:
      return "stop";
    case accel::v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    default:
      return "unspecified";
  }
}

template <typename Request>
void SetCommon(Request& request) {
  request.set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  request.mutable_sampling()->set_temperature(absl::GetFlag(FLAGS_temperature));
  request.mutable_sampling()->set_top_k(absl::GetFlag(FLAGS_top_k));
  request.mutable_sampling()->set_top_p(absl::GetFlag(FLAGS_top_p));
  if (absl::GetFlag(FLAGS_seed) >= 0) {
    request.mutable_sampling()->set_seed(static_cast<uint64_t>(absl::GetFlag(FLAGS_seed)));
  }
  for (const std::string& stop : absl::GetFlag(FLAGS_stop)) request.add_stop(stop);
}

// Runs a request whole or streamed and prints its text, then a summary on stderr.
template <typename Request, typename Unary, typename Stream>
int RunRequest(const char* command, const Request& request, Unary unary, Stream stream) {
  grpc::ClientContext context;
  std::string error;
  if (!Prepare(context, &error)) return Fail(error);
  accel::v1::GenerateResponse last;
  grpc::Status status;
  if (absl::GetFlag(FLAGS_stream)) {
    auto reader = stream(&context, request);
    accel::v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      std::cout << chunk.text() << std::flush;
      if (chunk.finish_reason() != accel::v1::FINISH_REASON_UNSPECIFIED) last = chunk;
    }
    status = reader->Finish();
    std::cout << "\n";
  } else {
    status = unary(&context, request, &last);
    if (status.ok()) std::cout << last.text() << "\n";
  }
  if (!status.ok()) {
    return Fail(absl::StrCat(command, ": ", status.error_code(), " ", status.error_message()));
  }
  std::fprintf(
      stderr, "[%s; %lld prompt + %lld generated tokens; first token %.3f s, total %.3f s]\n",
      FinishName(last.finish_reason()), static_cast<long long>(last.usage().prompt_tokens()),
      static_cast<long long>(last.usage().generated_tokens()),
      last.timing().time_to_first_token_seconds(), last.timing().total_seconds());
  return 0;
}

int Generate(accel::v1::Generation::Stub& stub) {
  accel::v1::GenerateRequest request;
  request.set_prompt(absl::GetFlag(FLAGS_prompt));
  SetCommon(request);
  return RunRequest(
      "generate", request,
      [&](grpc::ClientContext* c, const auto& r, auto* out) { return stub.Generate(c, r, out); },
      [&](grpc::ClientContext* c, const auto& r) { return stub.GenerateStream(c, r); });
}

// --messages' file: the earlier turns, as OpenAI's and transformers' JSON.
bool ReadMessages(const std::string& path, accel::v1::ChatRequest& request, std::string* error) {
  std::string text;
  if (!ReadFile(path, &text)) {
    *error = "--messages: cannot read " + path;
    return false;
  }
  const absl::StatusOr<nlohmann::json> parsed = accel::ParseJson(text, "--messages " + path);
  if (!parsed.ok()) {
    *error = std::string(parsed.status().message());
    return false;
  }
  const nlohmann::json& json = *parsed;
  if (!json.is_array()) {
    *error = "--messages " + path + ": expected a JSON array of messages";
    return false;
  }
  for (size_t i = 0; i < json.size(); ++i) {
    const nlohmann::json& m = json[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
        (m.contains("content") && !m["content"].is_string() && !m["content"].is_null())) {
      *error = absl::StrCat("--messages ", path, ": messages[", i,
                            "]: expected {\"role\": string, \"content\": string}");
      return false;
    }
    accel::v1::ChatMessage* message = request.add_messages();
    message->set_role(m["role"].get<std::string>());
    if (m.contains("content") && m["content"].is_string()) {
      message->set_content(m["content"].get<std::string>());
    }
  }
  return true;
}

int Chat(accel::v1::Generation::Stub& stub) {
  accel::v1::ChatRequest request;
  if (const std::string system = absl::GetFlag(FLAGS_system); !system.empty()) {
    accel::v1::ChatMessage* message = request.add_messages();
    message->set_role("system");
    message->set_content(system);
  }
  if (const std::string path = absl::GetFlag(FLAGS_messages); !path.empty()) {
    std::string error;
    if (!ReadMessages(path, request, &error)) return Fail(error);
  }
  if (const std::string prompt = absl::GetFlag(FLAGS_prompt); !prompt.empty()) {
    accel::v1::ChatMessage* message = request.add_messages();
    message->set_role("user");
    message->set_content(prompt);
  }
  if (request.messages().empty()) return Fail("chat: give --prompt or --messages");
  request.set_add_generation_prompt(true);
  SetCommon(request);
  return RunRequest(
      "chat", request,
      [&](grpc::ClientContext* c, const auto& r, auto* out) { return stub.Chat(c, r, out); },
      [&](grpc::ClientContext* c, const auto& r) { return stub.ChatStream(c, r); });
}

int Info(accel::v1::Generation::Stub& stub) {
  grpc::ClientContext context;
  std::string error;
  if (!Prepare(context, &error)) return Fail(error);
  accel::v1::ModelInfo info;
  grpc::Status status = stub.GetModelInfo(&context, {}, &info);
  if (!status.ok()) return Fail(absl::StrCat("info: ", status.error_message()));
  std::cout << info.DebugString();
  return 0;
}

int Health(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return Fail(absl::StrCat("health: ", status.error_message()));
  const bool serving = response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  std::cout << (serving ? "SERVING" : "NOT_SERVING") << "\n";
  return serving ? 0 : 1;
}

int Run(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "A client of accel-serve.\n"
      "  accel-client generate --prompt TEXT [--max_new_tokens N] [--stream]\n"
      "  accel-client chat --prompt TEXT [--system TEXT] [--messages FILE.json] [--stream]\n"
      "  accel-client info\n"
      "  accel-client health [--service accel.ready]   (exit 0 when SERVING)");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) return Fail("give one command: generate, chat, info or health (--help)");
  const std::string command = args[1];
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (const std::string ca = absl::GetFlag(FLAGS_tls_ca); !ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    if (!ReadFile(ca, &ssl.pem_root_certs)) return Fail("--tls_ca: cannot read " + ca);
    credentials = grpc::SslCredentials(ssl);
  }
  auto channel = grpc::CreateChannel(absl::GetFlag(FLAGS_address), credentials);
  auto stub = accel::v1::Generation::NewStub(channel);
  if (command == "generate") return Generate(*stub);
  if (command == "chat") return Chat(*stub);
  if (command == "info") return Info(*stub);
  if (command == "health") return Health(channel);
  return Fail("unknown command \"" + command + "\": generate, chat, info or health");
}

}  // namespace

int main(int argc, char** argv) { return accel::ToolMain("accel-client", argc, argv, Run); }
