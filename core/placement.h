// core/placement.h: where a tensor or module lives: a GPU, the CPU, or disk.
//
// Spelled as users write them in device maps and flags: 0 / "cuda:0" for a
// GPU, "cpu", "disk". In device-map JSON a GPU is the bare integer.
#ifndef ACCEL_CORE_PLACEMENT_H_
#define ACCEL_CORE_PLACEMENT_H_

#include <string>
#include <tuple>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel {

class Placement {
 public:
  enum class Kind { kCuda, kCpu, kDisk };

  static Placement Cuda(int index) { return Placement(Kind::kCuda, index); }
  static Placement Cpu() { return Placement(Kind::kCpu, 0); }
  static Placement Disk() { return Placement(Kind::kDisk, 0); }

  // "0", "cuda:0", "cuda" (= 0), "cpu", "disk". InvalidArgument otherwise
  // (negative indices, "mps", "gpu", ...).
  static absl::StatusOr<Placement> Parse(absl::string_view text);

  Kind kind() const { return kind_; }
  int index() const { return index_; }
  bool is_cuda() const { return kind_ == Kind::kCuda; }
  bool is_cpu() const { return kind_ == Kind::kCpu; }
  bool is_disk() const { return kind_ == Kind::kDisk; }

  // "0", "cpu", "disk": the device-map spelling (Accelerate's keys).
  std::string ToString() const;
  // "cuda:0", "cpu", "disk".
  std::string DeviceString() const;

  // Accelerate's order: GPUs by index, then cpu, then disk.
  friend bool operator<(const Placement& a, const Placement& b) {
    return std::tie(a.kind_, a.index_) < std::tie(b.kind_, b.index_);
  }
  friend bool operator==(const Placement& a, const Placement& b) {
    return a.kind_ == b.kind_ && a.index_ == b.index_;
  }
  friend bool operator!=(const Placement& a, const Placement& b) { return !(a == b); }

 private:
  Placement(Kind kind, int index) : kind_(kind), index_(index) {}

  Kind kind_;
  int index_;
};

}  // namespace accel

#endif  // ACCEL_CORE_PLACEMENT_H_
