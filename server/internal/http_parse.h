// server/internal/http_parse.h: the request-head parser of the HTTP/1.1
// server (http_server.h), alone: pure, torch-free and socket-free, so it is
// unit-tested (tests/server/http_parse_test.cc) and fuzzed
// (tests/fuzz/http_request_fuzz.cc) without a connection.
//
// The head is the bytes of a request before its blank line ("\r\n\r\n", not
// included). It is untrusted: the rules below are strict where a lax reading
// would let this server and a proxy in front of it frame a request
// differently (request smuggling) or let a header hide inside another
// (header injection):
//   - lines end with CRLF only: a bare CR, a bare LF or a NUL anywhere in the
//     head is an error (400), as is a line folded onto the one before it
//     (obs-fold: a line beginning with a space or a tab);
//   - the request line is `METHOD SP /target SP HTTP/1.x`, the method a
//     token; a header line is `name: value`, the name a non-empty token
//     (no spaces, no control characters); at most kMaxHttpHeaders headers
//     (431);
//   - any Transfer-Encoding other than `identity`, in any of its headers:
//     411 (request bodies need Content-Length);
//   - Content-Length: digits only, at most 2^64-1 (400), every
//     Content-Length header the same value (400), at most max_body_bytes
//     (413).
// The size of the head (431) and the reading of the body are the server's.
#ifndef ACCEL_SERVER_INTERNAL_HTTP_PARSE_H_
#define ACCEL_SERVER_INTERNAL_HTTP_PARSE_H_

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
  bool http10 = false;                                       // HTTP/1.0 (else HTTP/1.x)
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

#endif  // ACCEL_SERVER_INTERNAL_HTTP_PARSE_H_
