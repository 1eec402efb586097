#include "core/progress.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accel {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string Contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) out.append(buffer, n);
  return out;
}

TEST(ProgressTest, LineShowsBytesItemsAndBar) {
  std::FILE* f = std::tmpfile();
  Progress p("loading", int64_t{4} << 30, 8, Progress::Style::kSilent, f);
  p.Add(int64_t{1} << 30, 2);
  std::string line = p.Line();
  EXPECT_THAT(line,
              StartsWith("loading [######------------------] 1.00 GiB / 4.00 GiB, 2/8 tensors"));
  EXPECT_THAT(line, HasSubstr("/s"));
  p.Finish();
  EXPECT_EQ(Contents(f), "");  // silent
  std::fclose(f);
}

TEST(ProgressTest, LinesStyleLogsTheFinalState) {
  std::FILE* f = std::tmpfile();
  {
    Progress p("loading", 100, 2, Progress::Style::kLines, f);
    p.Add(50);
    p.Add(50);
  }  // the destructor finishes
  std::string out = Contents(f);
  EXPECT_THAT(out, HasSubstr("[########################] 100 B / 100 B, 2/2 tensors"));
  EXPECT_EQ(out.back(), '\n');
  EXPECT_EQ(out.find('\r'), std::string::npos);
  std::fclose(f);
}

TEST(ProgressTest, BarStyleRedrawsInPlaceAndEndsTheLine) {
  std::FILE* f = std::tmpfile();
  Progress p("loading", 10, 1, Progress::Style::kBar, f);
  p.Add(10);
  p.Finish();
  p.Finish();  // once only
  std::string out = Contents(f);
  EXPECT_EQ(out.front(), '\r');
  EXPECT_THAT(out, HasSubstr("\033[K"));
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  std::fclose(f);
}

}  // namespace
}  // namespace accel
