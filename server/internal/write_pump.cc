#include "server/internal/write_pump.h"

#include <utility>

namespace accel::server::internal {

WritePump::WritePump(std::function<void(const grpc::ByteBuffer*)> start_write,
                     std::function<void(const grpc::Status&)> finish)
    : start_write_(std::move(start_write)), finish_(std::move(finish)) {}

WritePump::Action WritePump::NextLocked() {
  Action action;
  if (!attached_ || finished_ || writing_) return action;
  while (!aborted_ && !queue_.empty()) {
    Entry entry = std::move(queue_.front());
    queue_.pop_front();
    if (entry.source != nullptr) {
      entry.source->queued_ = false;
      std::optional<grpc::ByteBuffer> message = entry.source->TakeMessage();
      if (!message) continue;
      in_flight_ = *std::move(message);
    } else {
      in_flight_ = *std::move(entry.message);
    }
    writing_ = true;
    action.write = &in_flight_;
    return action;
  }
  if (holds_ > 0 || !status_) return action;
  finished_ = true;
  action.finish = *status_;
  return action;
}

void WritePump::Run(const Action& action) {
  if (action.write != nullptr) start_write_(action.write);
  if (action.finish) finish_(*action.finish);
}

void WritePump::Notify(std::shared_ptr<Source> source) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_ || finished_ || source->queued_) return;
    source->queued_ = true;
    queue_.push_back({std::move(source), std::nullopt});
    action = NextLocked();
  }
  Run(action);
}

void WritePump::Write(grpc::ByteBuffer message) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_ || finished_) return;
    queue_.push_back({nullptr, std::move(message)});
    action = NextLocked();
  }
  Run(action);
}

void WritePump::FinishAfterWrites(grpc::Status status) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    if (!status_) status_ = std::move(status);
    action = NextLocked();
  }
  Run(action);
}

void WritePump::Abort(grpc::Status status) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_) {
      aborted_ = true;
      for (Entry& entry : queue_) {
        if (entry.source != nullptr) entry.source->queued_ = false;
      }
      queue_.clear();
      status_ = std::move(status);
    }
    action = NextLocked();
  }
  Run(action);
}

void WritePump::OnWriteDone(bool ok) {
  if (!ok) {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
    }
    Abort(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading the stream"));
    return;
  }
  Action action;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    action = NextLocked();
  }
  Run(action);
}

void WritePump::Hold() {
  absl::MutexLock lock(&mu_);
  ++holds_;
}

void WritePump::Release() {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    --holds_;
    action = NextLocked();
  }
  Run(action);
}

void WritePump::Detach() {
  absl::MutexLock lock(&mu_);
  attached_ = false;
}

bool WritePump::ending() const {
  absl::MutexLock lock(&mu_);
  return aborted_ || finished_;
}

}  // namespace accel::server::internal
