// accel-serve --tensor_parallel_size 2 as users run it: the leader starts its
// worker itself (or two invocations with --nnodes 2 form one server), answers
// as one process does, and a worker that is killed or stopped turns the
// leader not ready; the requests in flight end UNAVAILABLE, and the leader
// exits with status 4 within a bounded time. Configurations that cannot
// split are refused at start by name.
#include <csignal>
#include <fstream>
#include <future>
#include <spawn.h>
#include <string>
#include <sys/types.h>
#include <sys/wait.h>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/client_context.h>
#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "accel/v1/generation.grpc.pb.h"
#include "tests/server/generation_client.h"
#include "tests/server/server_process.h"
#include "tests/testing/multiprocess.h"

namespace accel::server {
namespace {

using ::accel::testing::BinDir;
using ::accel::testing::Call;
using ::accel::testing::Greedy;
using ::accel::testing::MadeModel;
using ::accel::testing::Metric;
using ::accel::testing::ServerProcess;
using ::accel::testing::TestModelDir;
using ::accel::v1::GenerateResponse;
using ::accel::v1::Generation;
using ::testing::HasSubstr;

// accel-serve's exit status when its group broke (server/internal/parallel_worker.h).
constexpr int kExitParallelFault = 4;

std::vector<int64_t> Tokens(const GenerateResponse& response) {
  return {response.token_ids().begin(), response.token_ids().end()};
}

// Every request sent at once, each from its own thread: each succeeds with
// the tokens `alone` holds for it (what one process made of it alone).
void ExpectTogetherAsAlone(Generation::Stub& stub,
                           const std::vector<accel::v1::GenerateRequest>& requests,
                           const std::vector<std::vector<int64_t>>& alone) {
  const size_t n = requests.size();
  std::vector<std::vector<int64_t>> together(n);
  std::vector<grpc::Status> statuses(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      GenerateResponse response;
      statuses[i] = Call(stub, requests[i], &response);
      together[i] = Tokens(response);
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < n; ++i) {
    EXPECT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
    EXPECT_EQ(together[i], alone[i]) << i;
  }
}

// The ranks this process started (its children).
std::vector<pid_t> Children(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/task/", pid, "/children"));
  std::vector<pid_t> out;
  for (pid_t child; in >> child;) out.push_back(child);
  return out;
}

std::unique_ptr<ServerProcess> StartParallel(std::vector<std::string> args) {
  args.push_back("--tensor_parallel_size=2");
  args.push_back(absl::StrCat("--master_port=", test::FreePort()));
  auto server = ServerProcess::Start(TestModelDir(), args);
  if (!server.ok()) {
    ADD_FAILURE() << server.status();
    return nullptr;
  }
  return *std::move(server);
}

TEST(ParallelServeTest, TwoRanksAnswerAsOneProcess) {
  auto single = ServerProcess::Start(TestModelDir(), {});
  ASSERT_TRUE(single.ok()) << single.status();
  auto parallel = StartParallel({"--parallel_timeout=20s"});
  ASSERT_NE(parallel, nullptr);
  EXPECT_EQ(Children(parallel->pid()).size(), 1u);
  for (const std::string prompt : {"The quick brown fox", "Hello"}) {
    GenerateResponse a, b;
    auto stub_a = Generation::NewStub((*single)->Channel());
    auto stub_b = Generation::NewStub(parallel->Channel());
    ASSERT_TRUE(Call(*stub_a, Greedy(prompt, 12), &a).ok());
    grpc::Status status = Call(*stub_b, Greedy(prompt, 12), &b);
    ASSERT_TRUE(status.ok()) << status.error_message() << parallel->Stderr();
    EXPECT_EQ(Tokens(b), Tokens(a)) << prompt;  // float32: the same tokens
    EXPECT_EQ(b.text(), a.text());
  }
  // SIGTERM: drained; the leader stops its worker, both exit 0.
  const std::vector<pid_t> workers = Children(parallel->pid());
  parallel->Signal(SIGTERM);
  EXPECT_EQ(parallel->Wait(absl::Seconds(30)), 0) << parallel->Stderr();
  EXPECT_THAT(parallel->Stderr(), HasSubstr("worker rank 1: the leader stopped the group"));
}

// --pipeline_parallel_size 2, and 2 x 2 with --tensor_parallel_size 2, under
// a KV budget far below what the requests need together (as
// ServeSchedulingTest's one-process test): every request finishes with the
// tokens one process makes alone, some preempted and recomputed, a shared
// prompt prefix found in the cache. Each rank holds 1 / (N x M) of a
// block's bytes (its layers, its heads), so 1 / (N x M) of one process's
// budget plans the same 32 blocks.
TEST(ParallelServeTest, PipelineStagesServeAsOneProcessWithPreemptionAndPrefixCaching) {
  auto single =
      ServerProcess::Start(TestModelDir(), {"--kv_cache_memory=64KiB", "--kv_block_size=4"});
  ASSERT_TRUE(single.ok()) << single.status();
  auto single_stub = Generation::NewStub((*single)->Channel());
  constexpr int kClients = 8;
  std::vector<accel::v1::GenerateRequest> requests;
  std::vector<std::vector<int64_t>> alone(kClients);
  for (int i = 0; i < kClients; ++i) {
    requests.push_back(Greedy(absl::StrCat("shared system prompt, then request ", i), 40));
    GenerateResponse response;
    ASSERT_TRUE(Call(*single_stub, requests.back(), &response).ok());
    alone[static_cast<size_t>(i)] = Tokens(response);
  }
  for (const int tp : {1, 2}) {
    SCOPED_TRACE(tp);
    auto parallel = ServerProcess::Start(
        TestModelDir(),
        {"--pipeline_parallel_size=2", absl::StrCat("--tensor_parallel_size=", tp),
         absl::StrCat("--kv_cache_memory=", 32 / tp, "KiB"), "--kv_block_size=4",
         "--parallel_timeout=30s", absl::StrCat("--master_port=", test::FreePort())});
    ASSERT_TRUE(parallel.ok()) << parallel.status();
    EXPECT_EQ(Children((*parallel)->pid()).size(), static_cast<size_t>(2 * tp - 1));
    EXPECT_EQ(Metric(**parallel, "accel_kv_cache_blocks"), 32);
    auto stub = Generation::NewStub((*parallel)->Channel());
    // One at a time: the shared prefix is found in the cache.
    GenerateResponse first;
    grpc::Status status = Call(*stub, requests[0], &first);
    ASSERT_TRUE(status.ok()) << status.error_message() << (*parallel)->Stderr();
    EXPECT_EQ(Tokens(first), alone[0]);
    ASSERT_TRUE(Call(*stub, requests[1], &first).ok());
    EXPECT_EQ(Tokens(first), alone[1]);
    EXPECT_GT(Metric(**parallel, "accel_prefix_cache_hits_total"), 0);
    // All together: some are preempted and recomputed.
    ExpectTogetherAsAlone(*stub, requests, alone);
    EXPECT_GT(Metric(**parallel, "accel_num_preemptions_total"), 0);
    // Two steps in flight (the default with 2 stages) over disjoint requests.
    EXPECT_GT(Metric(**parallel, "accel_pipeline_overlapped_steps_total"), 0);
    (*parallel)->Signal(SIGTERM);
    EXPECT_EQ((*parallel)->Wait(absl::Seconds(30)), 0) << (*parallel)->Stderr();
  }
}

TEST(ParallelServeTest, TwoInvocationsWithNnodesFormOneServer) {
  const std::string port = absl::StrCat("--master_port=", test::FreePort());
  // Node 1's accel-serve is rank 1: health only (it announces no serving
  // ports), waiting for node 0 to join.
  std::vector<std::string> node1 = {BinDir() + "/accel-serve",
                                    "--model=" + TestModelDir(),
                                    "--host=127.0.0.1",
                                    "--port=0",
                                    "--threads=1",
                                    "--tensor_parallel_size=2",
                                    "--nnodes=2",
                                    "--node_rank=1",
                                    "--master_addr=127.0.0.1",
                                    port,
                                    "--parallel_timeout=20s"};
  std::vector<char*> argv;
  for (std::string& a : node1) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t worker = -1;
  ASSERT_EQ(posix_spawn(&worker, argv[0], nullptr, nullptr, argv.data(), environ), 0);
  auto leader = ServerProcess::Start(TestModelDir(),
                                     {"--tensor_parallel_size=2", "--nnodes=2", "--node_rank=0",
                                      "--master_addr=127.0.0.1", port, "--parallel_timeout=20s"});
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_TRUE(Children((*leader)->pid()).empty());  // one rank a node: nothing to start
  GenerateResponse response;
  auto stub = Generation::NewStub((*leader)->Channel());
  grpc::Status status = Call(*stub, Greedy("The quick brown fox", 8), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.token_ids_size(), 8);
  (*leader)->Signal(SIGTERM);
  EXPECT_EQ((*leader)->Wait(absl::Seconds(30)), 0);
  // The leader stopped the group: node 1's process exits 0.
  int code = -1;
  for (int i = 0; i < 300 && code == -1; ++i) {
    int status_code = 0;
    if (waitpid(worker, &status_code, WNOHANG) == worker) {
      code = WIFEXITED(status_code) ? WEXITSTATUS(status_code) : 128 + WTERMSIG(status_code);
    } else {
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  if (code == -1) {
    kill(worker, SIGKILL);
    waitpid(worker, nullptr, 0);
  }
  EXPECT_EQ(code, 0);
}

// A worker killed or stopped while a long request runs: the request ends
// UNAVAILABLE, the leader stops being ready and exits with status 4 within
// the group's timeout plus the drain. With `pipeline`, the worker is the
// second of 2 stages and four requests keep two steps in flight: both end.
void ExpectFailureHandled(int signal, bool pipeline = false) {
  std::unique_ptr<ServerProcess> server;
  if (pipeline) {
    auto started =
        ServerProcess::Start(TestModelDir(), {"--pipeline_parallel_size=2", "--parallel_timeout=3s",
                                              "--shutdown_timeout=5s",
                                              absl::StrCat("--master_port=", test::FreePort())});
    ASSERT_TRUE(started.ok()) << started.status();
    server = *std::move(started);
  } else {
    server = StartParallel({"--parallel_timeout=3s", "--shutdown_timeout=5s"});
  }
  ASSERT_NE(server, nullptr);
  const std::vector<pid_t> workers = Children(server->pid());
  ASSERT_EQ(workers.size(), 1u);
  auto stub = Generation::NewStub(server->Channel());
  std::vector<std::future<grpc::Status>> running;
  for (int i = 0; i < (pipeline ? 4 : 1); ++i) {
    running.push_back(std::async(std::launch::async, [&, i] {
      GenerateResponse response;
      return Call(*stub, Greedy(absl::StrCat("The quick brown fox ", i), 200), &response);
    }));
  }
  absl::SleepFor(absl::Milliseconds(300));
  if (pipeline) {
    // Steps are in flight (the counter grows with every step overlapped).
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (Metric(*server, "accel_pipeline_overlapped_steps_total") < 2 && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_GE(Metric(*server, "accel_pipeline_overlapped_steps_total"), 2) << server->Stderr();
  }
  const absl::Time start = absl::Now();
  kill(workers[0], signal);
  for (std::future<grpc::Status>& r : running) {
    const grpc::Status status = r.get();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  }
  EXPECT_EQ(server->Wait(absl::Seconds(30)), kExitParallelFault) << server->Stderr();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3 + 5 + 10));
  EXPECT_THAT(server->Stderr(), HasSubstr("tensor parallel group broken"));
  if (signal == SIGSTOP) kill(workers[0], SIGKILL);
}

TEST(ParallelServeTest, AKilledWorkerEndsRequestsUnavailableAndTheLeaderExits) {
  ExpectFailureHandled(SIGKILL);
}

TEST(ParallelServeTest, AStoppedWorkerEndsRequestsUnavailableAndTheLeaderExits) {
  ExpectFailureHandled(SIGSTOP);
}

TEST(ParallelServeTest, AKilledStageWithTwoStepsInFlightEndsThemUnavailable) {
  ExpectFailureHandled(SIGKILL, /*pipeline=*/true);
}

TEST(ParallelServeTest, AStoppedStageWithTwoStepsInFlightEndsThemUnavailable) {
  ExpectFailureHandled(SIGSTOP, /*pipeline=*/true);
}

// Steps in flight on a mixture-of-experts family (a small Mixtral), with a
// KV budget that preempts, a shared prompt prefix and one request under a
// grammar (structured output): the tokens of one process. Speculative decoding (prompt lookup)
// falls back to one step at a time: the same tokens, no step overlapped.
TEST(ParallelServeTest, MixtralStepsInFlightAndSpeculativeFallbackServeAsOneProcess) {
  const std::string mixtral =
      MadeModel("parallel-mixtral",
                "--family mixtral --num_layers 2 --hidden_size 64 --num_kv_heads 2"
                " --num_experts 4 --num_experts_per_tok 2 --max_position_embeddings 256 --seed 5");
  auto single = ServerProcess::Start(mixtral, {"--kv_cache_memory=32KiB", "--kv_block_size=4"});
  ASSERT_TRUE(single.ok()) << single.status();
  auto single_stub = Generation::NewStub((*single)->Channel());
  constexpr int kClients = 6;
  std::vector<accel::v1::GenerateRequest> requests;
  std::vector<std::vector<int64_t>> alone(kClients);
  for (int i = 0; i < kClients; ++i) {
    requests.push_back(Greedy(absl::StrCat("a shared system prompt, then request ", i), 24));
    if (i == 1) {
      // Structured output in flight: the grammar's state is the request's,
      // and a request is in one step at a time.
      requests.back().set_ignore_eos(false);
      requests.back().mutable_structured_output()->set_regex("[A-F]{2}-[0-9]{1,3}");
    }
    GenerateResponse response;
    ASSERT_TRUE(Call(*single_stub, requests.back(), &response).ok());
    alone[static_cast<size_t>(i)] = Tokens(response);
    if (i == 1) {
      EXPECT_EQ(response.finish_reason(), accel::v1::FINISH_REASON_EOS);
    }
  }
  for (const bool speculative : {false, true}) {
    SCOPED_TRACE(speculative);
    std::vector<std::string> args = {"--pipeline_parallel_size=2", "--kv_cache_memory=16KiB",
                                     "--kv_block_size=4", "--parallel_timeout=30s",
                                     absl::StrCat("--master_port=", test::FreePort())};
    if (speculative) {
      args.push_back(R"(--speculative_config={"method": "ngram", "num_speculative_tokens": 2})");
    }
    auto parallel = ServerProcess::Start(mixtral, args);
    ASSERT_TRUE(parallel.ok()) << parallel.status();
    auto stub = Generation::NewStub((*parallel)->Channel());
    ExpectTogetherAsAlone(*stub, requests, alone);
    EXPECT_GT(Metric(**parallel, "accel_num_preemptions_total"), 0);
    EXPECT_GT(Metric(**parallel, "accel_prefix_cache_hits_total"), 0);
    if (speculative) {
      EXPECT_EQ(Metric(**parallel, "accel_pipeline_overlapped_steps_total"), 0);
    } else {
      EXPECT_GT(Metric(**parallel, "accel_pipeline_overlapped_steps_total"), 0);
    }
    (*parallel)->Signal(SIGTERM);
    EXPECT_EQ((*parallel)->Wait(absl::Seconds(30)), 0) << (*parallel)->Stderr();
  }
}

TEST(ParallelServeTest, WhatCannotSplitIsRefusedAtStartByName) {
  // 4 query heads over 3 ranks.
  auto three =
      ServerProcess::Start(TestModelDir(), {"--tensor_parallel_size=3"}, absl::Seconds(30));
  ASSERT_FALSE(three.ok());
  EXPECT_THAT(std::string(three.status().message()), HasSubstr("num_attention_heads (4)"));
  // 3 stages of 2 layers.
  auto pipeline =
      ServerProcess::Start(TestModelDir(), {"--pipeline_parallel_size=3"}, absl::Seconds(30));
  ASSERT_FALSE(pipeline.ok());
  EXPECT_THAT(std::string(pipeline.status().message()),
              HasSubstr("pipeline_parallel_size 3: more stages than config.json's "
                        "num_hidden_layers (2)"));
  auto micro = ServerProcess::Start(TestModelDir(),
                                    {"--pipeline_parallel_size=2", "--pipeline_micro_batches=-1"},
                                    absl::Seconds(30));
  ASSERT_FALSE(micro.ok());
  EXPECT_THAT(std::string(micro.status().message()),
              HasSubstr("--pipeline_micro_batches must be 0 or more"));
  auto nodes = ServerProcess::Start(TestModelDir(), {"--tensor_parallel_size=2", "--nnodes=2"},
                                    absl::Seconds(30));
  ASSERT_FALSE(nodes.ok());
  EXPECT_THAT(std::string(nodes.status().message()), HasSubstr("--master_addr"));
}

}  // namespace
}  // namespace accel::server
