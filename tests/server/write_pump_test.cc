// internal::WritePump on its own: a fake stream records what the pump asks
// of it, and the test completes writes when it chooses, as gRPC would.
#include "server/internal/write_pump.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/support/slice.h>
#include <gtest/gtest.h>

namespace accel::server::internal {
namespace {

grpc::ByteBuffer Buffer(const std::string& text) {
  grpc::Slice slice(text);
  return grpc::ByteBuffer(&slice, 1);
}

std::string Text(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string text;
  for (const grpc::Slice& s : slices)
    text.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return text;
}

struct FakeStream {
  std::vector<std::string> writes;
  std::optional<grpc::Status> finished;
  int finish_calls = 0;
  std::shared_ptr<WritePump> pump = std::make_shared<WritePump>(
      [this](const grpc::ByteBuffer* message) { writes.push_back(Text(*message)); },
      [this](const grpc::Status& status) {
        finished = status;
        ++finish_calls;
      });
};

// Text appended since its last turn, handed over as one message.
struct News : WritePump::Source {
  std::string pending;
  int taken = 0;
  std::optional<grpc::ByteBuffer> TakeMessage() override {
    ++taken;
    if (pending.empty()) return std::nullopt;
    grpc::ByteBuffer message = Buffer(pending);
    pending.clear();
    return message;
  }
};

TEST(WritePumpTest, OneWriteInFlightAndNewsMergedAtItsTurn) {
  FakeStream stream;
  auto news = std::make_shared<News>();
  news->pending = "a";
  stream.pump->Notify(news);
  ASSERT_EQ(stream.writes, std::vector<std::string>({"a"}));
  // Three chunks while "a" is in flight: queued once, written as one.
  for (const char* chunk : {"b", "c", "d"}) {
    news->pending += chunk;
    stream.pump->Notify(news);
  }
  EXPECT_EQ(stream.writes.size(), 1u);
  stream.pump->OnWriteDone(true);
  EXPECT_EQ(stream.writes, std::vector<std::string>({"a", "bcd"}));
  EXPECT_EQ(news->taken, 2);
  stream.pump->OnWriteDone(true);
  EXPECT_FALSE(stream.finished);
}

TEST(WritePumpTest, SourcesAndMessagesGoOutInOrderThenFinish) {
  FakeStream stream;
  auto first = std::make_shared<News>();
  auto second = std::make_shared<News>();
  first->pending = "1";
  second->pending = "2";
  stream.pump->Notify(first);
  stream.pump->Notify(second);
  stream.pump->Write(Buffer("error"));
  stream.pump->FinishAfterWrites(grpc::Status::OK);
  stream.pump->FinishAfterWrites(grpc::Status(grpc::StatusCode::INTERNAL, "second"));  // ignored
  EXPECT_FALSE(stream.finished);
  stream.pump->OnWriteDone(true);
  stream.pump->OnWriteDone(true);
  EXPECT_FALSE(stream.finished);
  stream.pump->OnWriteDone(true);
  EXPECT_EQ(stream.writes, std::vector<std::string>({"1", "2", "error"}));
  ASSERT_TRUE(stream.finished);
  EXPECT_TRUE(stream.finished->ok());
  EXPECT_EQ(stream.finish_calls, 1);
}

TEST(WritePumpTest, AbortDropsTheQueueAndFinishesAfterTheWriteInFlight) {
  FakeStream stream;
  auto news = std::make_shared<News>();
  news->pending = "a";
  stream.pump->Notify(news);
  stream.pump->Write(Buffer("queued"));
  stream.pump->Abort(grpc::Status(grpc::StatusCode::CANCELLED, "gone"));
  EXPECT_FALSE(stream.finished);  // "a" is still in flight
  EXPECT_TRUE(stream.pump->ending());
  news->pending = "late";
  stream.pump->Notify(news);  // ignored once aborted
  stream.pump->OnWriteDone(true);
  EXPECT_EQ(stream.writes, std::vector<std::string>({"a"}));
  ASSERT_TRUE(stream.finished);
  EXPECT_EQ(stream.finished->error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(stream.finish_calls, 1);
}

TEST(WritePumpTest, AFailedWriteFinishesAsCancelled) {
  FakeStream stream;
  stream.pump->Write(Buffer("a"));
  stream.pump->Write(Buffer("b"));
  stream.pump->OnWriteDone(false);
  EXPECT_EQ(stream.writes, std::vector<std::string>({"a"}));
  ASSERT_TRUE(stream.finished);
  EXPECT_EQ(stream.finished->error_code(), grpc::StatusCode::CANCELLED);
}

TEST(WritePumpTest, HoldKeepsFinishBackUntilReleased) {
  FakeStream stream;
  stream.pump->Hold();
  stream.pump->FinishAfterWrites(grpc::Status::OK);
  EXPECT_FALSE(stream.finished);
  stream.pump->Release();
  EXPECT_TRUE(stream.finished);
}

TEST(WritePumpTest, NothingReachesTheStreamAfterDetach) {
  FakeStream stream;
  stream.pump->Write(Buffer("a"));
  stream.pump->Detach();
  stream.pump->Write(Buffer("b"));
  stream.pump->OnWriteDone(true);
  stream.pump->FinishAfterWrites(grpc::Status::OK);
  EXPECT_EQ(stream.writes, std::vector<std::string>({"a"}));
  EXPECT_FALSE(stream.finished);
}

}  // namespace
}  // namespace accel::server::internal
