// server/internal/write_pump.h: the writes of one streaming call, shared by
// every streaming handler (GenerateStream, ModelStreamInfer).
//
// gRPC's callback API allows one write in flight per call, and Finish only
// once nothing is in flight; news comes from the scheduler thread, which must
// never block. So news is queued and written one message at a time: a source
// (a generation) waits in the queue at most once, and when its turn comes it
// hands over everything it produced meanwhile as one message, so a slow
// client gets fewer, larger messages, never an unbounded queue or a blocked
// scheduler.
//
//   auto pump = std::make_shared<WritePump>(
//       [this](const grpc::ByteBuffer* m) { StartWrite(m); },
//       [this](const grpc::Status& s) { Finish(s); });
//   pump->Notify(source);               // a sink, on the scheduler thread
//   pump->FinishAfterWrites(status);    // the request ended
//   void OnWriteDone(bool ok) override { pump->OnWriteDone(ok); ... }
//   void OnCancel() override { pump->Abort(Cancelled); ... }
//   void OnDone() override { pump->Detach(); delete this; }
//
// Thread-safe. The two callbacks are called with no lock held, because gRPC
// may run OnWriteDone (which comes back here) on the thread that calls
// StartWrite or Finish; never after Detach.
#ifndef ACCEL_SERVER_INTERNAL_WRITE_PUMP_H_
#define ACCEL_SERVER_INTERNAL_WRITE_PUMP_H_

#include <deque>
#include <functional>
#include <memory>
#include <optional>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace accel::server::internal {

class WritePump {
 public:
  // Something with news to write.
  class Source {
   public:
    virtual ~Source() = default;
    // Called (under the pump's lock) when this source's turn comes: one
    // message with everything since its last turn, or nullopt when there is
    // nothing to say. Must not call back into the pump.
    virtual std::optional<grpc::ByteBuffer> TakeMessage() = 0;

   private:
    friend class WritePump;
    bool queued_ = false;  // guarded by the pump's lock
  };

  WritePump(std::function<void(const grpc::ByteBuffer*)> start_write,
            std::function<void(const grpc::Status&)> finish);
  WritePump(const WritePump&) = delete;
  WritePump& operator=(const WritePump&) = delete;

  // `source` has news: it takes its turn after what is queued (once, however
  // often it is notified before its turn comes).
  void Notify(std::shared_ptr<Source> source) ABSL_LOCKS_EXCLUDED(mu_);
  // A ready message, written after what is queued.
  void Write(grpc::ByteBuffer message) ABSL_LOCKS_EXCLUDED(mu_);
  // Finishes the call with `status` once everything queued is written (and
  // no Hold is left). The first status given wins.
  void FinishAfterWrites(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the call now: what is queued is dropped, and the call finishes with
  // `status` as soon as the write in flight (if any) is done.
  void Abort(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // The reactor's OnWriteDone. A failed write means the client is gone:
  // Abort(CANCELLED); the caller stops the work behind the call.
  void OnWriteDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_);
  // Holds off Finish until Release (a bidi reactor's read being handled:
  // no read may start after Finish).
  void Hold() ABSL_LOCKS_EXCLUDED(mu_);
  void Release() ABSL_LOCKS_EXCLUDED(mu_);
  // The reactor's OnDone: the callbacks are never called again.
  void Detach() ABSL_LOCKS_EXCLUDED(mu_);

  // Abort was called or Finish decided: new work need not start.
  bool ending() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::shared_ptr<Source> source;
    std::optional<grpc::ByteBuffer> message;
  };
  struct Action {
    const grpc::ByteBuffer* write = nullptr;
    std::optional<grpc::Status> finish;
  };
  // The next write, or the Finish once nothing is left to do.
  Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(const Action& action);

  const std::function<void(const grpc::ByteBuffer*)> start_write_;
  const std::function<void(const grpc::Status&)> finish_;

  mutable absl::Mutex mu_;
  std::deque<Entry> queue_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer in_flight_ ABSL_GUARDED_BY(mu_);  // the message of the write in flight
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  int holds_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<grpc::Status> status_ ABSL_GUARDED_BY(mu_);  // to finish with
  bool finished_ ABSL_GUARDED_BY(mu_) = false;               // Finish was called
  bool attached_ ABSL_GUARDED_BY(mu_) = true;
};

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_WRITE_PUMP_H_
