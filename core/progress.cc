#include "core/progress.h"

#include <algorithm>
#include <unistd.h>

#include "absl/strings/str_format.h"

#include "core/bytes.h"

namespace accel {
namespace {

constexpr int kBarWidth = 24;
// A terminal bar is redrawn at most this often; log lines come this rarely.
constexpr auto kBarInterval = std::chrono::milliseconds(100);
constexpr auto kLineInterval = std::chrono::seconds(5);

}  // namespace

Progress::Progress(std::string label, int64_t total_bytes, int64_t total_items, Style style,
                   std::FILE* out)
    : label_(std::move(label)),
      total_bytes_(total_bytes),
      total_items_(total_items),
      style_(style),
      out_(out != nullptr ? out : stderr),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {
  if (style_ == Style::kAuto) style_ = ::isatty(::fileno(out_)) ? Style::kBar : Style::kLines;
}

Progress::~Progress() { Finish(); }

void Progress::Add(int64_t bytes, int64_t items) {
  bytes_ += bytes;
  items_ += items;
  Draw(false);
}

void Progress::Finish() {
  if (finished_) return;
  finished_ = true;
  Draw(true);
}

std::string Progress::Line() const {
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double fraction =
      total_bytes_ > 0
          ? std::min(1.0, static_cast<double>(bytes_) / static_cast<double>(total_bytes_))
          : 1.0;
  const int filled = static_cast<int>(fraction * kBarWidth);
  std::string bar = std::string(filled, '#') + std::string(kBarWidth - filled, '-');
  const int64_t rate =
      seconds > 0 ? static_cast<int64_t>(static_cast<double>(bytes_) / seconds) : 0;
  return absl::StrFormat("%s [%s] %s / %s, %d/%d tensors, %s/s, %.1f s", label_, bar,
                         FormatBytes(bytes_), FormatBytes(total_bytes_), items_, total_items_,
                         FormatBytes(rate), seconds);
}

void Progress::Draw(bool final) {
  if (style_ == Style::kSilent) return;
  const auto now = std::chrono::steady_clock::now();
  if (!final && now - last_draw_ < (style_ == Style::kBar ? kBarInterval : kLineInterval)) return;
  last_draw_ = now;
  if (style_ == Style::kBar) {
    std::fprintf(out_, "\r%s\033[K%s", Line().c_str(), final ? "\n" : "");
  } else {
    std::fprintf(out_, "%s\n", Line().c_str());
  }
  std::fflush(out_);
}

}  // namespace accel
