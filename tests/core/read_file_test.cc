// ReadRegularFile: a file's bytes; a missing file NotFound; anything that is
// not a regular file (a FIFO, whose open() would wait for a writer; a
// directory; a device) refused by name at once; a bound on the size.
#include "core/read_file.h"

#include <chrono>
#include <fcntl.h>
#include <future>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel {
namespace {

using ::accel::test::IsOkAndHolds;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(ReadRegularFile, ReadsAFileWhole) {
  TempDir dir;
  const std::string big(200000, 'x');
  EXPECT_THAT(ReadRegularFile(dir.Write("a.json", "{}")), IsOkAndHolds(std::string("{}")));
  EXPECT_THAT(ReadRegularFile(dir.Write("big", big)), IsOkAndHolds(big));
  EXPECT_THAT(ReadRegularFile(dir.Write("empty", "")), IsOkAndHolds(std::string()));
  EXPECT_THAT(ReadRegularFile(dir.File("missing.json")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.json")));
  EXPECT_THAT(ReadRegularFile(dir.Write("c", "123456"), 5),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("over the bound of 5")));
}

TEST(ReadRegularFile, RefusesWhatIsNotARegularFileWithoutWaiting) {
  TempDir dir;
  const std::string fifo = dir.File("config.json");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto read = std::async(std::launch::async, [&] { return ReadRegularFile(fifo); });
  if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "waits on the FIFO";
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // lets it go
    if (fd >= 0) ::close(fd);
  }
  EXPECT_THAT(read.get(), StatusIs(absl::StatusCode::kInvalidArgument,
                                   AllOf(HasSubstr(fifo), HasSubstr("a FIFO"))));
  EXPECT_THAT(ReadRegularFile(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a directory")));
  EXPECT_THAT(ReadRegularFile("/dev/null"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a device")));
}

}  // namespace
}  // namespace accel
