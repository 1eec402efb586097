// server/internal/http_request_head.h: how the OpenAI HTTP API reads a
// request head: Boost.Beast's HTTP/1.1 parser (http::basic_parser) under a
// few rules of ours, pure (no socket), so it is unit-tested
// (tests/server/http_request_head_test.cc) and fuzzed
// (tests/fuzz/http_request_fuzz.cc) alone. The transport
// (http_transport.h) hands it the bytes before the blank line.
//
// The head is untrusted. Beast checks the grammar: the request line (a
// token method, HTTP/1.0 or 1.1), header names (tokens, no space before the
// colon), header values (no control characters), Content-Length (digits,
// no overflow, several equal values or none) and its conflict with
// Transfer-Encoding. Ours, before Beast sees the bytes, where a lax reading
// would let this server and a proxy in front of it frame a request
// differently (request smuggling) or let a header hide inside another:
//   - lines end with CRLF only: a bare CR, a bare LF or a NUL anywhere is
//     refused (400), and so is a line folded onto the one before it
//     (obs-fold, which Beast would unfold);
//   - at most kMaxHttpHeaders header lines (431);
//   - any Transfer-Encoding other than `identity`, in any of its headers:
//     411 (request bodies need Content-Length);
// and after Beast: an origin-form target ("/..."; 400), a Content-Length of
// at most max_body_bytes (413). The size of the head (431) and the reading
// of the body are the transport's.
#ifndef ACCEL_SERVER_INTERNAL_HTTP_REQUEST_HEAD_H_
#define ACCEL_SERVER_INTERNAL_HTTP_REQUEST_HEAD_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/string_view.h"

namespace accel::server::internal {

// The most header lines a request may have.
inline constexpr size_t kMaxHttpHeaders = 100;

struct HttpRequestHead {
  std::string method;
  std::string path;                                          // starts with '/', without the query
  std::string query;                                         // after the first '?', or empty
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased, values trimmed
  bool http10 = false;                                       // HTTP/1.0 (else HTTP/1.1)
  // Whether the connection stays open after the answer: HTTP/1.1 unless
  // `Connection: close`; HTTP/1.0 only with `Connection: keep-alive`.
  bool keep_alive = true;
  uint64_t content_length = 0;   // 0 without Content-Length; at most max_body_bytes
  bool expect_continue = false;  // `Expect: 100-continue`

  // The first header of that (lower-case) name, or null.
  const std::string* Header(absl::string_view name) const;
};

// Why a head is refused: the status to answer (400, 411, 413 or 431) and
// the message for the error body.
struct HttpParseError {
  int status = 400;
  std::string message;
};

// A head, or why it is refused. std::variant rather than absl::StatusOr: the
// error is the HTTP status to answer, not an absl code.
using HttpParseResult = std::variant<HttpRequestHead, HttpParseError>;

HttpParseResult ParseHttpRequestHead(absl::string_view head, uint64_t max_body_bytes);

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_HTTP_REQUEST_HEAD_H_
