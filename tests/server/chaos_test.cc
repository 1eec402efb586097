// Chaos against the real accel-serve binary, the network half of issue 33's
// outside test: descriptor exhaustion, slow and idle sockets, hostile JSON.
// Each fault has its expected outcome: an answer within a bound (far above
// the normal time, far below what the fault cost before), and a server that
// is healthy afterwards (ready, live, every port answering).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/client_context.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "accel/v1/generation.grpc.pb.h"
#include "tests/server/generation_client.h"
#include "tests/server/raw_http.h"
#include "tests/server/server_process.h"
#include "tests/testing/temp_dir.h"

namespace accel::server {
namespace {

using ::accel::test::ConnectTo;
using ::accel::test::Exchange;
using ::accel::test::RawSocket;
using ::accel::test::SendAll;
using ::accel::test::StatusOf;
using ::accel::testing::ServerProcess;
using ::accel::testing::TestModelDir;
using ::testing::HasSubstr;
using ::testing::Not;

// accel-serve with the OpenAI API on a free port (--http_port 0 is "off"),
// retried if another process took the port in between.
absl::StatusOr<std::unique_ptr<ServerProcess>> StartWithHttp(const std::string& model,
                                                             const std::vector<std::string>& args,
                                                             int max_open_files = 0) {
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::vector<std::string> all = args;
    all.push_back(absl::StrCat("--http_port=", test::FreePort()));
    auto server =
        ServerProcess::Start(model, all, absl::Seconds(60), /*wait_ready=*/true, max_open_files);
    if (server.ok()) return server;
    last = server.status();
  }
  return last;
}

// Everything a healthy server answers: live and ready on the health
// service, a greedy Generate, the OpenAI API, a scrape. Within `bound`.
void ExpectHealthy(ServerProcess& server, absl::Duration bound) {
  const absl::Time until = absl::Now() + bound;
  EXPECT_TRUE(server.WaitForHealth("accel.live", until)) << server.Stderr();
  EXPECT_TRUE(server.WaitForHealth("accel.ready", until));
  auto stub = accel::v1::Generation::NewStub(server.Channel());
  accel::v1::GenerateResponse response;
  const grpc::Status generated = testing::Call(*stub, testing::Greedy("Hello", 4), &response,
                                               std::max(until - absl::Now(), absl::Seconds(1)));
  EXPECT_TRUE(generated.ok()) << generated.error_message();
  EXPECT_EQ(response.token_ids_size(), 4);
  if (server.http_port() > 0) {
    EXPECT_EQ(StatusOf(Exchange(server.http_port(), "GET", "/v1/models", "", "",
                                std::max(until - absl::Now(), absl::Seconds(1)))),
              200);
  }
  if (server.http_port() > 0) {
    // /metrics on the API port too (as vLLM serves it), without a token.
    const std::string scrape = Exchange(server.http_port(), "GET", "/metrics");
    EXPECT_EQ(StatusOf(scrape), 200);
    EXPECT_THAT(scrape, HasSubstr("accel_ready 1"));
  }
  absl::StatusOr<std::string> metrics = server.Metrics();
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics, HasSubstr("accel_ready 1"));
  EXPECT_THAT(*metrics, HasSubstr("accel_listener_up{listener=\"grpc\"} 1"));
}

// The outside test's episode: 300 idle TCP connections against a
// 256-descriptor limit (100 on each port). Before, gRPC's accept failed
// with EMFILE and its port never accepted again, the process spun 1.7
// cores, and the HTTP and metrics ports stalled. Now each port holds at
// most its share of the descriptors (the rest wait in the backlog), the
// OpenAI API keeps answering meanwhile, and once the sockets close every
// port accepts again.
TEST(ChaosTest, DescriptorExhaustionEndsAndEveryPortAcceptsAgain) {
  auto server = StartWithHttp(TestModelDir(),
                              {"--liveness_probe_interval=500ms", "--http_request_timeout=30s"},
                              /*max_open_files=*/256);
  ASSERT_TRUE(server.ok()) << server.status();
  ServerProcess& s = **server;
  ASSERT_GT(s.http_port(), 0);
  EXPECT_THAT(s.Stderr(), HasSubstr("open files: 256 (the hard limit)"));
  EXPECT_THAT(s.Stderr(), HasSubstr("connections at once: grpc 96, http 72, metrics 12"));

  std::vector<RawSocket> idle;
  for (int port : {s.grpc_port(), s.http_port(), s.metrics_port()}) {
    for (int i = 0; i < 100; ++i) {
      RawSocket socket = ConnectTo(port);
      ASSERT_TRUE(socket.ok()) << "port " << port << ", connection " << i;
      idle.push_back(std::move(socket));
    }
  }
  absl::SleepFor(absl::Seconds(1));
  // Meanwhile the OpenAI API answers: a newcomer takes an idle socket's place.
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(StatusOf(Exchange(s.http_port(), "GET", "/v1/models", "", "", absl::Seconds(10))),
              200);
  }
  // And the process did not run out: the liveness watchdog saw every port.
  absl::SleepFor(absl::Seconds(2));
  EXPECT_THAT(s.Stderr(), Not(HasSubstr("stopped answering")));

  idle.clear();
  ExpectHealthy(s, absl::Seconds(30));
  EXPECT_THAT(s.Stderr(), Not(HasSubstr("stopped answering")));
}

// 600 sockets on the OpenAI port, half idle and half trickling a request
// head a byte at a time: the old server gave each a thread up to 512 and
// locked every other client out (and most of its 503s were lost to a TCP
// reset). Now real clients are answered throughout.
TEST(ChaosTest, SlowAndIdleSocketsDoNotLockClientsOut) {
  auto server = StartWithHttp(TestModelDir(), {"--http_request_timeout=60s"});
  ASSERT_TRUE(server.ok()) << server.status();
  ServerProcess& s = **server;
  std::vector<RawSocket> sockets;
  for (int i = 0; i < 600; ++i) {
    sockets.push_back(ConnectTo(s.http_port()));
    ASSERT_TRUE(sockets.back().ok()) << i;
  }
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ";
  for (size_t round = 0; round < 5; ++round) {
    for (size_t i = 0; i < sockets.size(); i += 2) {
      send(sockets[i].fd(), &head[round % head.size()], 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    const absl::Time start = absl::Now();
    const std::string response = Exchange(
        s.http_port(), "POST", "/v1/completions",
        R"({"prompt": "Hello", "max_tokens": 2, "temperature": 0})", "", absl::Seconds(20));
    EXPECT_EQ(StatusOf(response), 200) << response;
    EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  }
  sockets.clear();
  ExpectHealthy(s, absl::Seconds(30));
}

// User and system CPU time of process `pid` so far (/proc/PID/stat), zero if
// it cannot be read.
absl::Duration CpuTimeOf(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The fields after the command's closing parenthesis: state is the 3rd
  // field, utime the 14th and stime the 15th.
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) return absl::ZeroDuration();
  std::vector<std::string> fields = absl::StrSplit(text.substr(paren + 2), ' ');
  if (fields.size() < 13) return absl::ZeroDuration();
  const double ticks = std::atof(fields[11].c_str()) + std::atof(fields[12].c_str());
  return absl::Seconds(ticks / static_cast<double>(::sysconf(_SC_CLK_TCK)));
}

// Hostile JSON. A body of 100,000 keys cost 24 s of CPU on /v1/completions
// (nlohmann::ordered_json looked every key up linearly), the same in gRPC
// Chat's tools_json went on for 27 s after the client's 3 s deadline, and a
// deeply nested body could overflow the stack. Now each is refused at once,
// by name, and the server goes on.
TEST(ChaosTest, HostileJsonIsRefusedQuicklyAndTheServerGoesOn) {
  auto server = StartWithHttp(TestModelDir(), {});
  ASSERT_TRUE(server.ok()) << server.status();
  ServerProcess& s = **server;
  std::string keys = R"({"prompt": "hi", "x": {)";
  for (int i = 0; i < 100000; ++i) absl::StrAppend(&keys, i ? "," : "", "\"k", i, "\":0");
  keys += "}}";
  ASSERT_GT(keys.size(), 1000000u);
  absl::Time start = absl::Now();
  std::string response = Exchange(s.http_port(), "POST", "/v1/completions", keys);
  EXPECT_EQ(StatusOf(response), 400) << response.substr(0, 300);
  EXPECT_THAT(response, HasSubstr("object keys"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));

  start = absl::Now();
  response = Exchange(s.http_port(), "POST", "/v1/chat/completions",
                      std::string(1000000, '[') + std::string(1000000, ']'));
  EXPECT_EQ(StatusOf(response), 400);
  EXPECT_THAT(response, HasSubstr("nests deeper than"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));

  // A 4 MB body whose client closes the connection as soon as it is sent:
  // the parse (and the queueing) stop for a client that has gone, counted
  // as cancelled; before, the body was read through and refused as invalid
  // (its prompt is too long) for nobody.
  std::string ids = R"({"prompt": [)";
  while (ids.size() < (4u << 20) - 16) ids += "1,";
  ids += "1]}";
  const auto failures = [&s](const std::string& reason) {
    absl::StatusOr<std::string> text = s.Metrics();
    const std::string series =
        absl::StrCat("accel_request_failure_total{reason=\"", reason, "\"} ");
    const size_t at = text.ok() ? text->find(series) : std::string::npos;
    return at == std::string::npos ? 0.0 : std::atof(text->c_str() + at + series.size());
  };
  bool cancelled = false;
  // The close must reach the server before the parse ends (milliseconds);
  // it nearly always does on the loopback, but a run may lose the race.
  for (int attempt = 0; attempt < 3 && !cancelled; ++attempt) {
    const double before = failures("cancelled");
    {
      RawSocket client = ConnectTo(s.http_port());
      ASSERT_TRUE(SendAll(client.fd(), test::Request("POST", "/v1/completions", ids)));
    }
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (failures("cancelled") == before && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    cancelled = failures("cancelled") > before;
  }
  EXPECT_TRUE(cancelled);

  // gRPC Chat: one tools_json of 100,000 keys (1.5 MB), a 3 s deadline.
  accel::v1::ChatRequest chat;
  accel::v1::ChatMessage* message = chat.add_messages();
  message->set_role("user");
  message->set_content("hi");
  std::string tool = R"({"type": "function", "function": {"name": "f", "parameters": {)";
  for (int i = 0; i < 100000; ++i) absl::StrAppend(&tool, i ? "," : "", "\"p", i, "\":{}");
  tool += "}}}";
  chat.add_tools_json(tool);
  auto stub = accel::v1::Generation::NewStub(s.Channel());
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    accel::v1::GenerateResponse reply;
    start = absl::Now();
    const grpc::Status status = stub->Chat(&context, chat, &reply);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("tools_json[0]: has more than"));
    EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  }
  // Many tools of few keys each: the budget is the request's, not each field's.
  accel::v1::ChatRequest many = chat;
  many.clear_tools_json();
  std::string small = R"({"type": "function", "function": {"name": "f", "parameters": {)";
  for (int i = 0; i < 1000; ++i) absl::StrAppend(&small, i ? "," : "", "\"p", i, "\":{}");
  small += "}}}";
  for (int i = 0; i < 100; ++i) many.add_tools_json(small);
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    accel::v1::GenerateResponse reply;
    const grpc::Status status = stub->Chat(&context, many, &reply);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("(with the fields before it)"));
  }
  // A tools_json that takes long to read (60 MB of empty arrays: 20 million
  // values, no key to cap, seconds of parsing) past its deadline: the parse
  // stops at the deadline (counted as a timeout), rather than reading on for
  // a client that has gone and then refusing the array (counted invalid).
  accel::v1::ChatRequest slow = chat;
  slow.clear_tools_json();
  std::string arrays = "[";
  arrays.reserve(60 << 20);
  while (arrays.size() < (60u << 20)) arrays += "[],";
  arrays += "[]]";
  slow.add_tools_json(arrays);
  // Each call: its status, how long it took, which failure counters moved
  // (waiting up to `wait_for_count` for the handler to count it: a parse
  // read through takes seconds, more on a loaded machine; a call that ended
  // before any handler ran is never counted), and the server's CPU time
  // meanwhile. A call whose deadline has passed is counted a timeout
  // whether or not its parse ran on, so the CPU time is what tells them
  // apart.
  struct Outcome {
    grpc::StatusCode code;
    absl::Duration took;
    double timeouts;
    double invalid;
    absl::Duration server_cpu;
  };
  const auto call_slow = [&](absl::Duration deadline, absl::Duration wait_for_count) {
    const double timeouts_before = failures("timeout");
    const double invalid_before = failures("invalid");
    const absl::Duration cpu_before = CpuTimeOf(s.pid());
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    accel::v1::GenerateResponse reply;
    const absl::Time called = absl::Now();
    const grpc::Status status = stub->Chat(&context, slow, &reply);
    const absl::Duration took = absl::Now() - called;
    const absl::Time until = absl::Now() + wait_for_count;
    while (failures("timeout") == timeouts_before && failures("invalid") == invalid_before &&
           absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    return Outcome{status.error_code(), took, failures("timeout") - timeouts_before,
                   failures("invalid") - invalid_before, CpuTimeOf(s.pid()) - cpu_before};
  };
  // Read through (a minute's deadline), the array is refused, counted
  // invalid: what arriving and parsing it costs here.
  const Outcome whole = call_slow(absl::Minutes(1), absl::Seconds(20));
  ASSERT_EQ(whole.code, grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_EQ(whole.invalid, 1);
  const absl::Duration read_through_took = whole.took;
  const absl::Duration read_through_cpu = whole.server_cpu;
  ASSERT_GT(read_through_took, absl::Milliseconds(200))
      << "too fast a parse to put a deadline inside";
  // The deadline must fall after the 60 MB have arrived (before that, gRPC
  // ends the call before any handler runs, and nothing is counted) and
  // before the parse ends (after that, the array is refused, counted
  // invalid; a fast CI machine once ended it inside half the read-through
  // call's time). Arrival takes tens of milliseconds on a quiet loopback
  // but has passed 500 ms on a loaded machine. So the deadline is searched
  // for, halving the gap each call: later when nothing counted the call,
  // earlier when the parse ended first, and earlier still when a deadline
  // cut the parse in its second half (the earlier the cut, the plainer the
  // difference in CPU time from a parse that read on).
  std::optional<Outcome> cut;
  absl::Duration cut_deadline;
  absl::Duration too_early = absl::ZeroDuration();
  absl::Duration late_enough = read_through_took;
  absl::Duration deadline = std::min(absl::Milliseconds(500), read_through_took / 2);
  for (int attempt = 0; attempt < 8; ++attempt) {
    const Outcome outcome = call_slow(deadline, 2 * read_through_took + absl::Seconds(2));
    if (outcome.timeouts > 0) {
      cut = outcome;
      cut_deadline = deadline;
    }
    if (outcome.timeouts > 0 || outcome.invalid > 0) {
      late_enough = deadline;
    } else {
      too_early = deadline;
    }
    if (cut && (cut_deadline <= read_through_took / 2 ||
                late_enough - too_early < read_through_took / 16)) {
      break;
    }
    deadline = (too_early + late_enough) / 2;
  }
  ASSERT_TRUE(cut.has_value()) << "no deadline between " << too_early << " and " << late_enough
                               << " fell inside the parse";
  EXPECT_EQ(cut->code, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(cut->timeouts, 1);
  EXPECT_EQ(cut->invalid, 0);
  EXPECT_LT(cut->server_cpu, read_through_cpu * 3 / 4)
      << "the parse ran on past a deadline of " << cut_deadline << " (a read-through call took "
      << read_through_took << ")";
  ExpectHealthy(s, absl::Seconds(10));
}

// What clients see of the server's own paths and of what they sent: a 60 KB
// path is not echoed back whole, `bearer` in any case is accepted (RFC
// 7235), and an error from the model's chat template names the model's
// folder by its last component, never where the server keeps it.
TEST(ChaosTest, AnswersShowNoServerPathsAndEchoLittle) {
  test::TempDir dir;
  const std::string deep = dir.path() + "/srv/secret-location/models/my-model";
  std::filesystem::create_directories(deep);
  std::filesystem::copy(TestModelDir(), deep, std::filesystem::copy_options::recursive);
  {
    std::ofstream jinja(deep + "/chat_template.jinja");
    jinja << "{{ raise_exception('roles must alternate user/assistant') }}";
  }
  const std::string token_file = dir.Write("token", "s3cret\n");
  auto server = StartWithHttp(deep, {absl::StrCat("--auth_token_file=", token_file)});
  ASSERT_TRUE(server.ok()) << server.status();
  ServerProcess& s = **server;
  const std::string auth = "Authorization: bearer s3cret\r\n";

  const std::string long_path = "/" + std::string(60000, 'a');
  for (const char* method : {"GET", "POST"}) {
    const std::string response = Exchange(s.http_port(), method, long_path, "", auth);
    EXPECT_EQ(StatusOf(response), 404);
    EXPECT_LT(response.size(), 2000u) << "the path came back whole";
  }
  EXPECT_EQ(StatusOf(Exchange(s.http_port(), "DELETE", "/v1/completions", "", auth)), 405);
  // A 3,000-byte method on a known path: 405, the method quoted short.
  const std::string long_method =
      Exchange(s.http_port(), std::string(3000, 'X'), "/v1/models", "", auth);
  EXPECT_EQ(StatusOf(long_method), 405);
  EXPECT_LT(long_method.size(), 2000u);

  for (const char* scheme : {"Bearer", "bearer", "BEARER", "bEaReR"}) {
    EXPECT_EQ(StatusOf(Exchange(s.http_port(), "GET", "/v1/models", "",
                                absl::StrCat("Authorization: ", scheme, " s3cret\r\n"))),
              200)
        << scheme;
  }
  EXPECT_EQ(
      StatusOf(Exchange(s.http_port(), "GET", "/v1/models", "", "Authorization: Basic s3cret\r\n")),
      401);

  const std::string chat =
      Exchange(s.http_port(), "POST", "/v1/chat/completions",
               R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})", auth);
  EXPECT_EQ(StatusOf(chat), 400) << chat;
  EXPECT_THAT(chat, HasSubstr("roles must alternate"));
  EXPECT_THAT(chat, HasSubstr("my-model/"));
  EXPECT_THAT(chat, Not(HasSubstr("secret-location")));
  EXPECT_THAT(chat, Not(HasSubstr(dir.path())));
  // The same over gRPC.
  accel::v1::ChatRequest request;
  accel::v1::ChatMessage* message = request.add_messages();
  message->set_role("user");
  message->set_content("hi");
  auto stub = accel::v1::Generation::NewStub(s.Channel());
  grpc::ClientContext context;
  context.AddMetadata("authorization", "bearer s3cret");
  accel::v1::GenerateResponse reply;
  const grpc::Status status = stub->Chat(&context, request, &reply);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("roles must alternate"));
  EXPECT_THAT(status.error_message(), Not(HasSubstr("secret-location")));
}

}  // namespace
}  // namespace accel::server
