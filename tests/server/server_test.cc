// server::Server in-process: a real gRPC server on a loopback port and real
// gRPC clients (generated stubs, or raw bytes through a generic stub).
#include "server/server.h"

#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "accel/v1/generation.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "tests/server/generation_client.h"
#include "tests/server/server_process.h"
#include "tests/testing/temp_dir.h"

namespace accel::server {
namespace {

using ::accel::test::TempDir;
using ::accel::testing::Call;
using ::accel::testing::Greedy;
using ::accel::testing::HttpGet;
using ::accel::testing::MadeModel;
using ::accel::testing::MetricValue;
using ::accel::testing::RunCommand;
using ::accel::testing::TestModelDir;
using ::accel::v1::GenerateRequest;
using ::accel::v1::GenerateResponse;
using ::accel::v1::Generation;
using ::testing::HasSubstr;
using ::testing::Not;

// A model slow enough (a few ms a step on a cpu) that a long request is
// still running while the test does something else (as serve_test's).
const std::string& SlowModelDir() {
  static const std::string dir =
      MadeModel("serve-slow",
                "--family llama --num_layers 6 --hidden_size 384 --num_kv_heads 2"
                " --max_position_embeddings 4096 --seed 4");
  return dir;
}

ServerOptions Options(const std::string& model) {
  ServerOptions options;
  options.engine.model_dir = model;
  options.host = "127.0.0.1";
  options.port = 0;
  options.metrics_port = 0;
  return options;
}

std::unique_ptr<Server> StartReady(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  if (!server.ok()) {
    ADD_FAILURE() << server.status();
    return nullptr;
  }
  const absl::Status ready = (*server)->WaitReady(absl::Seconds(120));
  if (!ready.ok()) {
    ADD_FAILURE() << ready;
    return nullptr;
  }
  return *std::move(server);
}

std::shared_ptr<grpc::Channel> Channel(const Server& server) {
  return grpc::CreateChannel(absl::StrCat("127.0.0.1:", server.ports().grpc),
                             grpc::InsecureChannelCredentials());
}

// A unary call with `body` as the request's bytes, whatever they are.
grpc::Status RawCall(grpc::Channel& channel, const std::string& method, const std::string& body) {
  grpc::GenericStub stub(std::shared_ptr<grpc::Channel>(&channel, [](grpc::Channel*) {}));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status status) { done.set_value(std::move(status)); });
  return done.get_future().get();
}

double Metric(const Server& server, const std::string& series) {
  absl::StatusOr<std::string> response = HttpGet(server.ports().metrics, "/metrics");
  if (!response.ok()) return -1;
  return MetricValue(*response, series).value_or(0);
}

bool WaitForMetric(const Server& server, const std::string& series, double want) {
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (absl::Now() < end) {
    if (Metric(server, series) == want) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

TEST(ServerTest, ServesThenDrainsRefusingNewCallsAsUnavailable) {
  ServerOptions options = Options(SlowModelDir());
  options.shutdown_timeout = absl::Seconds(1);
  std::unique_ptr<Server> server = StartReady(options);
  ASSERT_NE(server, nullptr);
  EXPECT_GT(server->ports().grpc, 0);
  EXPECT_GT(server->ports().metrics, 0);
  auto stub = Generation::NewStub(Channel(*server));
  GenerateResponse response;
  ASSERT_TRUE(Call(*stub, Greedy("hello", 2), &response).ok());
  EXPECT_EQ(response.token_ids_size(), 2);

  // A long stream is running when the drain starts.
  grpc::ClientContext stream_context;
  auto stream = stub->GenerateStream(&stream_context, Greedy("a long story", 4000));
  GenerateResponse chunk;
  ASSERT_TRUE(stream->Read(&chunk));
  std::thread drain([&server] { EXPECT_EQ(server->Drain(), 1); });

  // While it drains, a new call is refused by the server itself (its
  // message, not a closed port's), so clients retry another replica.
  auto health = grpc::health::v1::Health::NewStub(Channel(*server));
  grpc::Status refused;
  for (int i = 0; i < 200; ++i) {
    refused = Call(*stub, Greedy("late", 2), &response, absl::Seconds(5));
    if (!refused.ok()) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(refused.error_code(), grpc::UNAVAILABLE) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("draining"));

  // The stream is ended by the grace period, with what it had generated.
  int64_t tokens = chunk.token_ids_size();
  accel::v1::FinishReason finish = accel::v1::FINISH_REASON_UNSPECIFIED;
  while (stream->Read(&chunk)) {
    tokens += chunk.token_ids_size();
    finish = chunk.finish_reason();
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(finish, accel::v1::FINISH_REASON_CANCELLED);
  EXPECT_GT(tokens, 0);
  EXPECT_LT(tokens, 4000);
  drain.join();
  server->Wait();  // returns at once once drained
}

TEST(ServerTest, CallsDuringTheLastMomentsOfADrainAreUnavailableNotCancelled) {
  std::unique_ptr<Server> server = StartReady(Options(TestModelDir()));
  ASSERT_NE(server, nullptr);
  std::atomic<bool> stop{false};
  std::vector<std::thread> clients;
  std::vector<std::vector<grpc::StatusCode>> codes(8);
  std::vector<std::string> odd(8);
  for (size_t c = 0; c < codes.size(); ++c) {
    clients.emplace_back([&, c] {
      // Each client keeps its connection, as a real one would.
      auto stub = Generation::NewStub(Channel(*server));
      GenerateResponse response;
      // A client that is told UNAVAILABLE goes to another replica.
      while (!stop.load() && (codes[c].empty() || codes[c].back() != grpc::UNAVAILABLE)) {
        const grpc::Status status = Call(*stub, Greedy("x", 1), &response, absl::Seconds(10));
        codes[c].push_back(status.error_code());
        if (!status.ok() && status.error_code() != grpc::UNAVAILABLE) {
          absl::StrAppend(&odd[c], status.error_code(), ": ", status.error_message(), "; ");
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  server->Drain();
  absl::SleepFor(absl::Milliseconds(200));
  stop = true;
  for (std::thread& t : clients) t.join();
  for (const std::string& text : odd) EXPECT_EQ(text, "");
  int ok = 0;
  int unavailable = 0;
  for (const auto& list : codes) {
    for (grpc::StatusCode code : list) {
      if (code == grpc::OK) ++ok;
      if (code == grpc::UNAVAILABLE) ++unavailable;
      EXPECT_TRUE(code == grpc::OK || code == grpc::UNAVAILABLE) << "code " << code;
    }
  }
  EXPECT_GT(ok, 0);
  EXPECT_GT(unavailable, 0);
}

TEST(ServerTest, UnparsableRequestsAreInvalidArgumentNamingTheProblem) {
  std::unique_ptr<Server> server = StartReady(Options(TestModelDir()));
  ASSERT_NE(server, nullptr);
  std::shared_ptr<grpc::Channel> channel = Channel(*server);

  // A prompt cut inside a character: proto3 strings must be UTF-8.
  GenerateRequest bad_utf8 = Greedy("caf\xc3", 2);
  grpc::Status status =
      RawCall(*channel, "/accel.v1.Generation/Generate", bad_utf8.SerializeAsString());
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("accel.v1.GenerateRequest.prompt"));
  EXPECT_THAT(status.error_message(), HasSubstr("UTF-8"));

  // Bytes that are no protobuf message at all.
  status = RawCall(*channel, "/accel.v1.Generation/Generate", "\xff\xff\xff\xff");
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("not a valid accel.v1.GenerateRequest"));

  // The stream says the same.
  auto stub = Generation::NewStub(channel);
  grpc::ClientContext context;
  GenerateResponse chunk;
  auto stream = stub->GenerateStream(&context, bad_utf8);
  while (stream->Read(&chunk)) {
  }
  status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("accel.v1.GenerateRequest.prompt"));

  // KServe: a nested string (an input's name) is found too.
  inference::ModelInferRequest infer;
  infer.add_inputs()->set_name("text\xff");
  status =
      RawCall(*channel, "/inference.GRPCInferenceService/ModelInfer", infer.SerializeAsString());
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("inference.ModelInferRequest.InferInputTensor.name"));

  // Every method parses its own body: the small ones too.
  inference::ModelReadyRequest ready;
  ready.set_name("m\xff");
  status =
      RawCall(*channel, "/inference.GRPCInferenceService/ModelReady", ready.SerializeAsString());
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("inference.ModelReadyRequest.name"));
  status = RawCall(*channel, "/accel.v1.Generation/GetModelInfo", "\x0a");
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("not a valid accel.v1.GetModelInfoRequest"));

  // On ModelStreamInfer the error is in-band and the stream goes on.
  auto kserve = inference::GRPCInferenceService::NewStub(channel);
  grpc::ClientContext stream_context;
  auto bidi = kserve->ModelStreamInfer(&stream_context);
  inference::ModelInferRequest bad;
  bad.set_id("bad");
  bad.set_model_name("m\xff");
  ASSERT_TRUE(bidi->Write(bad));
  inference::ModelStreamInferResponse answer;
  ASSERT_TRUE(bidi->Read(&answer));
  EXPECT_THAT(answer.error_message(), HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(answer.error_message(), HasSubstr("inference.ModelInferRequest.model_name"));
  inference::ModelInferRequest good;
  good.set_id("good");
  auto* input = good.add_inputs();
  input->set_name("input_ids");
  input->set_datatype("INT64");
  input->add_shape(2);
  input->mutable_contents()->add_int64_contents(1);
  input->mutable_contents()->add_int64_contents(2);
  (*good.mutable_parameters())["max_tokens"].set_int64_param(2);
  ASSERT_TRUE(bidi->Write(good));
  bidi->WritesDone();
  ASSERT_TRUE(bidi->Read(&answer));
  EXPECT_EQ(answer.error_message(), "");
  EXPECT_EQ(answer.infer_response().id(), "good");
  EXPECT_TRUE(bidi->Finish().ok());
}

TEST(ServerTest, ErrorsQuoteUntrustedStringsShortAndEscaped) {
  std::unique_ptr<Server> server = StartReady(Options(TestModelDir()));
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(Channel(*server));
  GenerateRequest request = Greedy("hello", 2);
  request.set_model(std::string(1, '\0') + std::string(99999, 'a'));
  GenerateResponse response;
  grpc::Status status = Call(*stub, request, &response);
  EXPECT_EQ(status.error_code(), grpc::NOT_FOUND);
  EXPECT_LT(status.error_message().size(), 300u) << status.error_message().substr(0, 300);
  EXPECT_THAT(status.error_message(), HasSubstr("\"\\000aaa"));
  EXPECT_THAT(status.error_message(), HasSubstr("... (100000 bytes)"));
  EXPECT_EQ(status.error_message().find('\0'), std::string::npos);

  // KServe: a parameter's key and a tensor's name.
  auto kserve = inference::GRPCInferenceService::NewStub(Channel(*server));
  inference::ModelInferRequest infer;
  auto* input = infer.add_inputs();
  input->set_name("text_input");
  input->set_datatype("BYTES");
  input->add_shape(1);
  input->mutable_contents()->add_bytes_contents("hello");
  (*infer.mutable_parameters())[std::string(50000, 'k') + "\n"].set_int64_param(1);
  inference::ModelInferResponse answer;
  grpc::ClientContext context;
  status = kserve->ModelInfer(&context, infer, &answer);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_LT(status.error_message().size(), 1000u);
  EXPECT_THAT(status.error_message(), HasSubstr("(50001 bytes)"));
  EXPECT_THAT(status.error_message(), Not(HasSubstr("\n")));
}

TEST(ServerTest, ClientDeadlinesAreCountedAsTimeouts) {
  std::unique_ptr<Server> server = StartReady(Options(SlowModelDir()));
  ASSERT_NE(server, nullptr);
  auto stub = Generation::NewStub(Channel(*server));
  GenerateResponse response;
  grpc::Status status =
      Call(*stub, Greedy("a long story", 4000), &response, absl::Milliseconds(300));
  EXPECT_EQ(status.error_code(), grpc::DEADLINE_EXCEEDED);
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(300)));
    auto stream = stub->GenerateStream(&context, Greedy("a long story", 4000));
    GenerateResponse chunk;
    while (stream->Read(&chunk)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::DEADLINE_EXCEEDED);
  }
  EXPECT_TRUE(WaitForMetric(*server, "accel_num_requests_running", 0));
  EXPECT_TRUE(WaitForMetric(*server, "accel_request_failure_total{reason=\"timeout\"}", 2));
  EXPECT_EQ(Metric(*server, "accel_request_failure_total{reason=\"cancelled\"}"), 0);
}

TEST(ServerTest, MaxConnectionAgeClosesIdleConnections) {
  ServerOptions options = Options(TestModelDir());
  options.max_connection_age = absl::Milliseconds(500);
  options.max_connection_age_grace = absl::Milliseconds(200);
  std::unique_ptr<Server> server = StartReady(options);
  ASSERT_NE(server, nullptr);
  std::shared_ptr<grpc::Channel> channel = Channel(*server);
  auto stub = Generation::NewStub(channel);
  grpc::ClientContext context;
  accel::v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&context, accel::v1::GetModelInfoRequest(), &info).ok());
  ASSERT_EQ(channel->GetState(/*try_to_connect=*/false), GRPC_CHANNEL_READY);
  // The server sends GOAWAY at the age: the channel leaves READY (IDLE until
  // the next call reconnects).
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (channel->GetState(false) == GRPC_CHANNEL_READY && absl::Now() < end) {
    channel->WaitForStateChange(GRPC_CHANNEL_READY,
                                std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  }
  EXPECT_NE(channel->GetState(false), GRPC_CHANNEL_READY);
  // And a new call simply reconnects.
  grpc::ClientContext again;
  EXPECT_TRUE(stub->GetModelInfo(&again, accel::v1::GetModelInfoRequest(), &info).ok());
}

TEST(ServerTest, ConnectionsLiveOnWithoutMaxConnectionAge) {
  ServerOptions options = Options(TestModelDir());
  options.max_connection_age = absl::ZeroDuration();
  std::unique_ptr<Server> server = StartReady(options);
  ASSERT_NE(server, nullptr);
  std::shared_ptr<grpc::Channel> channel = Channel(*server);
  auto stub = Generation::NewStub(channel);
  grpc::ClientContext context;
  accel::v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&context, accel::v1::GetModelInfoRequest(), &info).ok());
  EXPECT_FALSE(channel->WaitForStateChange(
      GRPC_CHANNEL_READY, std::chrono::system_clock::now() + std::chrono::milliseconds(1500)));
}

TEST(ServerTest, BadTlsFilesAreNamedWithTheReason) {
  TempDir dir;
  const std::string cert = dir.path() + "/cert.pem";
  const std::string key = dir.path() + "/key.pem";
  const std::string other_key = dir.path() + "/other.pem";
  const std::string garbage = dir.path() + "/garbage.pem";
  for (const std::string& k : {key, other_key}) {
    ASSERT_EQ(RunCommand("openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
                         "-keyout " +
                         k + " -out " + (k == key ? cert : dir.path() + "/unused.pem") +
                         " > /dev/null 2>&1"),
              0);
  }
  std::ofstream(garbage) << "-----BEGIN CERTIFICATE-----\nnot base64 at all\n"
                            "-----END CERTIFICATE-----\n";
  ServerOptions options = Options(TestModelDir());

  options.tls_cert_file = garbage;
  options.tls_key_file = key;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("--tls_cert: " + garbage));
  EXPECT_THAT(server.status().message(), HasSubstr("no valid PEM certificate"));
  EXPECT_THAT(server.status().message(), Not(HasSubstr("listen")));

  options.tls_cert_file = cert;
  options.tls_key_file = cert;  // a certificate where the key should be
  server = Server::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(), HasSubstr("--tls_key: " + cert));
  EXPECT_THAT(server.status().message(), HasSubstr("no valid unencrypted PEM private key"));

  options.tls_key_file = other_key;
  server = Server::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(),
              HasSubstr("--tls_key: " + other_key + " is not the private key of the certificate"));

  options.tls_key_file = dir.path() + "/missing.pem";
  server = Server::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(), HasSubstr("cannot read " + dir.path() + "/missing.pem"));

  options.tls_key_file = key;  // the right pair starts
  server = Server::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
}

}  // namespace
}  // namespace accel::server
