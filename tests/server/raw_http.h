// Raw TCP and HTTP/1.1 for the server tests: what no client library does
// (idle sockets, trickled heads, closes at chosen moments).
#ifndef ACCEL_TESTS_SERVER_RAW_HTTP_H_
#define ACCEL_TESTS_SERVER_RAW_HTTP_H_

#include <cerrno>
#include <cstdlib>
#include <string>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace accel::test {

// A socket closed when it goes out of scope.
class RawSocket {
 public:
  RawSocket() = default;
  explicit RawSocket(int fd) : fd_(fd) {}
  RawSocket(RawSocket&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  RawSocket& operator=(RawSocket&& other) noexcept {
    if (this != &other) {
      Close();
      fd_ = other.fd_;
      other.fd_ = -1;
    }
    return *this;
  }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;
  ~RawSocket() { Close(); }

  int fd() const { return fd_; }
  bool ok() const { return fd_ >= 0; }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// A socket connected to 127.0.0.1:port; not ok() when connect fails.
inline RawSocket ConnectTo(int port) {
  RawSocket s(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (!s.ok() || connect(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return RawSocket();
  }
  return s;
}

// A port nobody listens on now (the kernel's pick, released).
inline int FreePort() {
  RawSocket s(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // Port 0: the kernel picks a free one; 0 back if it could not.
  if (bind(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return 0;
  socklen_t length = sizeof(addr);
  if (getsockname(s.fd(), reinterpret_cast<sockaddr*>(&addr), &length) != 0) return 0;
  return ntohs(addr.sin_port);
}

inline bool SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// Reads until the peer closes, `until` appears, or `timeout` passes.
// `error` (when given) is the errno of a failed read (ECONNRESET: a reset),
// 0 after a clean end or a timeout.
inline std::string ReadUntil(int fd, const std::string& until = "",
                             absl::Duration timeout = absl::Seconds(30), int* error = nullptr) {
  timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buffer[8192];
  if (error != nullptr) *error = 0;
  while (until.empty() || out.find(until) == std::string::npos) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && error != nullptr && errno != EAGAIN) *error = errno;
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

inline std::string Request(const std::string& method, const std::string& path,
                           const std::string& body = "", bool close = true,
                           const std::string& extra_headers = "") {
  return absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: x\r\n",
                      close ? "Connection: close\r\n" : "",
                      "Content-Type: application/json\r\nContent-Length: ", body.size(), "\r\n",
                      extra_headers, "\r\n", body);
}

// One request on a fresh connection (Connection: close); the whole response.
inline std::string Exchange(int port, const std::string& method, const std::string& path,
                            const std::string& body = "", const std::string& extra_headers = "",
                            absl::Duration timeout = absl::Seconds(30)) {
  RawSocket s = ConnectTo(port);
  if (!s.ok()) return "";
  SendAll(s.fd(), Request(method, path, body, true, extra_headers));
  return ReadUntil(s.fd(), "", timeout);
}

inline int StatusOf(const std::string& response) {
  if (response.size() < 12 || response.compare(0, 7, "HTTP/1.") != 0) return 0;
  return std::atoi(response.substr(9, 3).c_str());
}

}  // namespace accel::test

#endif  // ACCEL_TESTS_SERVER_RAW_HTTP_H_
