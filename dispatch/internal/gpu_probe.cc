#include "dispatch/internal/gpu_probe.h"

#include <cstdlib>
#include <dlfcn.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace accel::dispatch::internal {
namespace {

// The few NVML entry points we call (nvml.h, stable since driver 3xx).
struct NvmlMemory {
  unsigned long long total;  // NOLINT(google-runtime-int): NVML's type
  unsigned long long free;   // NOLINT(google-runtime-int)
  unsigned long long used;   // NOLINT(google-runtime-int)
};
using InitFn = int (*)();
using CountFn = int (*)(unsigned int*);
using HandleFn = int (*)(unsigned int, void**);
using MemoryFn = int (*)(void*, NvmlMemory*);

}  // namespace

std::optional<std::vector<int>> ParseVisibleDevices(const char* env) {
  if (env == nullptr) return std::nullopt;
  std::vector<int> out;
  for (absl::string_view item : absl::StrSplit(env, ',')) {
    item = absl::StripAsciiWhitespace(item);
    int index = 0;
    if (item.empty() || !absl::ascii_isdigit(static_cast<unsigned char>(item[0]))) {
      if (out.empty() && (absl::StartsWith(item, "GPU-") || absl::StartsWith(item, "MIG-")))
        return std::nullopt;
      break;
    }
    if (!absl::SimpleAtoi(item, &index) || index < 0) break;
    out.push_back(index);
  }
  return out;
}

std::vector<std::pair<int, int64_t>> ProbeGpuFreeMemory() {
  std::vector<std::pair<int, int64_t>> out;
  void* nvml = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml == nullptr) return out;
  auto init = reinterpret_cast<InitFn>(::dlsym(nvml, "nvmlInit_v2"));
  auto shutdown = reinterpret_cast<InitFn>(::dlsym(nvml, "nvmlShutdown"));
  auto count = reinterpret_cast<CountFn>(::dlsym(nvml, "nvmlDeviceGetCount_v2"));
  auto handle = reinterpret_cast<HandleFn>(::dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2"));
  auto memory = reinterpret_cast<MemoryFn>(::dlsym(nvml, "nvmlDeviceGetMemoryInfo"));
  if (init == nullptr || shutdown == nullptr || count == nullptr || handle == nullptr ||
      memory == nullptr || init() != 0) {
    ::dlclose(nvml);
    return out;
  }
  unsigned int n = 0;
  if (count(&n) == 0) {
    std::vector<int> physical;
    if (auto visible = ParseVisibleDevices(std::getenv("CUDA_VISIBLE_DEVICES"))) {
      physical = *visible;
    } else {
      for (unsigned int i = 0; i < n; ++i) physical.push_back(static_cast<int>(i));
    }
    for (size_t cuda = 0; cuda < physical.size(); ++cuda) {
      void* device = nullptr;
      NvmlMemory info{};
      if (physical[cuda] >= static_cast<int>(n)) break;  // CUDA stops at an invalid entry too
      if (handle(static_cast<unsigned int>(physical[cuda]), &device) != 0 ||
          memory(device, &info) != 0)
        continue;
      out.emplace_back(static_cast<int>(cuda), static_cast<int64_t>(info.free));
    }
  }
  shutdown();
  ::dlclose(nvml);
  return out;
}

}  // namespace accel::dispatch::internal
