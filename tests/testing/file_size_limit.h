// A full disk, simulated: while alive, files this process writes cannot
// grow past `bytes` (RLIMIT_FSIZE), and writes past it fail with EFBIG
// instead of raising SIGXFSZ.
#ifndef ACCEL_TESTS_TESTING_FILE_SIZE_LIMIT_H_
#define ACCEL_TESTS_TESTING_FILE_SIZE_LIMIT_H_

#include <cstdint>
#include <signal.h>
#include <sys/resource.h>

namespace accel::test {

class FileSizeLimit {
 public:
  explicit FileSizeLimit(uint64_t bytes) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ok_ = sigaction(SIGXFSZ, &ignore, &previous_signal_) == 0 &&
          getrlimit(RLIMIT_FSIZE, &previous_limit_) == 0;
    struct rlimit limit = previous_limit_;
    limit.rlim_cur = bytes;
    ok_ = ok_ && setrlimit(RLIMIT_FSIZE, &limit) == 0;
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &previous_limit_);
    sigaction(SIGXFSZ, &previous_signal_, nullptr);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

  // Whether the limit is in force (tests ASSERT this).
  bool ok() const { return ok_; }

 private:
  struct sigaction previous_signal_ {};
  struct rlimit previous_limit_ {};
  bool ok_ = false;
};

}  // namespace accel::test

#endif  // ACCEL_TESTS_TESTING_FILE_SIZE_LIMIT_H_
