#include "engine/internal/cuda_sync_counter.h"

#include <algorithm>
#include <map>

#ifdef ACCEL_WITH_ENGINE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>
#endif

#include "core/torch_compat.h"

namespace accel::engine::internal {

namespace {

struct Counts {
  int64_t count = 0;
  std::map<std::string, int64_t> sites;
};

}  // namespace

#ifdef ACCEL_WITH_ENGINE_CUDA
namespace {

constexpr int64_t kKeptSites = 256;
constexpr size_t kFrames = 14;

// Counts libtorch's "called a synchronizing CUDA operation" warnings and
// passes every other warning on to the handler it replaced.
class CountingHandler final : public c10::WarningHandler {
 public:
  CountingHandler(Counts* counts, c10::WarningHandler* next) : counts_(counts), next_(next) {}

#if ACCEL_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& warning) override {
    if (!Count(warning.msg())) next_->process(warning);
  }
#else
  void process(const c10::SourceLocation& where, const std::string& msg,
               const bool verbatim) override {
    if (!Count(msg)) next_->process(where, msg, verbatim);
  }
#endif

 private:
  bool Count(const std::string& msg) {
    if (msg.find("synchronizing CUDA operation") == std::string::npos) return false;
    if (counts_->count++ < kKeptSites) {
      ++counts_->sites[c10::get_backtrace(/*frames_to_skip=*/3, kFrames)];
    }
    return true;
  }

  Counts* counts_;
  c10::WarningHandler* next_;
};

#if ACCEL_TORCH_AT_LEAST(2, 0)
c10::WarningHandler* GetHandler() { return c10::WarningUtils::get_warning_handler(); }
void SetHandler(c10::WarningHandler* h) { c10::WarningUtils::set_warning_handler(h); }
#else
c10::WarningHandler* GetHandler() { return c10::Warning::get_warning_handler(); }
void SetHandler(c10::WarningHandler* h) { c10::Warning::set_warning_handler(h); }
#endif

}  // namespace

// The counts, and what the counter replaced (put back when it goes).
struct CudaSyncCounter::State {
  Counts counts;
  c10::WarningHandler* previous = GetHandler();
  c10::cuda::SyncDebugMode mode = c10::cuda::warning_state().get_sync_debug_mode();
  CountingHandler handler{&counts, previous};
};

bool CudaSyncCounter::Available() { return true; }

CudaSyncCounter::CudaSyncCounter() : state_(std::make_unique<State>()) {
  SetHandler(&state_->handler);
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
}

CudaSyncCounter::~CudaSyncCounter() {
  c10::cuda::warning_state().set_sync_debug_mode(state_->mode);
  SetHandler(state_->previous);
}

#else

struct CudaSyncCounter::State {
  Counts counts;
};

bool CudaSyncCounter::Available() { return false; }
CudaSyncCounter::CudaSyncCounter() : state_(std::make_unique<State>()) {}
CudaSyncCounter::~CudaSyncCounter() = default;

#endif

int64_t CudaSyncCounter::count() const { return state_->counts.count; }

std::vector<std::pair<std::string, int64_t>> CudaSyncCounter::Sites() const {
  std::vector<std::pair<std::string, int64_t>> out(state_->counts.sites.begin(),
                                                   state_->counts.sites.end());
  std::stable_sort(out.begin(), out.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  return out;
}

}  // namespace accel::engine::internal
