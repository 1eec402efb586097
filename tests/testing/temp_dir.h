// A fresh temporary folder per test, removed with everything in it.
#ifndef ACCEL_TESTS_TESTING_TEMP_DIR_H_
#define ACCEL_TESTS_TESTING_TEMP_DIR_H_

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace accel::test {

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base ? base : "/tmp") + "/accel_test_XXXXXX";
    path_ = ::mkdtemp(pattern.data()) ? pattern : "";
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }

  const std::string& path() const { return path_; }
  std::string File(absl::string_view name) const { return path_ + "/" + std::string(name); }

  // Writes `bytes` to `name` inside the folder and returns its path.
  std::string Write(absl::string_view name, absl::string_view bytes) const {
    std::string p = File(name);
    std::ofstream(p, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }

 private:
  std::string path_;
};

// The regular files below `dir`, recursively, as sorted paths.
inline std::vector<std::string> FilesUnder(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file()) out.push_back(it->path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace accel::test

#endif  // ACCEL_TESTS_TESTING_TEMP_DIR_H_
