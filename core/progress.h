// core/progress.h: progress of a long operation (loading a model) as bytes
// and items: a redrawn bar when stderr is a terminal, a log line every few
// seconds (and at the end) otherwise.
//
//   Progress progress("loading", total_bytes, total_tensors);
//   progress.Add(bytes_of_this_tensor);   // once per tensor
//   progress.Finish();
#ifndef ACCEL_CORE_PROGRESS_H_
#define ACCEL_CORE_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace accel {

// Not thread-safe; one thread reports.
class Progress {
 public:
  enum class Style { kAuto, kBar, kLines, kSilent };

  // `out` defaults to stderr; kAuto draws a bar when it is a terminal.
  Progress(std::string label, int64_t total_bytes, int64_t total_items, Style style = Style::kAuto,
           std::FILE* out = nullptr);
  ~Progress();  // Finish()es if needed
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void Add(int64_t bytes, int64_t items = 1);
  void Finish();

  // The line that would be drawn now: "loading [#####-----] 1.50/3.00 GiB,
  // 12/24 tensors, 850 MiB/s". Public for tests.
  std::string Line() const;

 private:
  void Draw(bool final);

  std::string label_;
  int64_t total_bytes_;
  int64_t total_items_;
  int64_t bytes_ = 0;
  int64_t items_ = 0;
  Style style_;
  std::FILE* out_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  bool finished_ = false;
};

}  // namespace accel

#endif  // ACCEL_CORE_PROGRESS_H_
