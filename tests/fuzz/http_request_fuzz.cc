// libFuzzer target for the HTTP request-head parser, Boost.Beast's parser
// under our rules (server/internal/http_request_head.h; scripts/fuzz.sh runs
// it). The input is a
// request head (the bytes before the blank line). Any input must parse or
// be refused with 400, 411, 413 or 431 and a message; a parsed head must
// keep the parser's promises: a path starting with '/', header names that
// are lower-case tokens, values without CR, LF or NUL or surrounding
// whitespace, at most kMaxHttpHeaders headers, a Content-Length within the
// limit.
#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

#include "server/internal/http_request_head.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

constexpr uint64_t kMaxBody = 4 << 20;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using accel::server::internal::HttpParseError;
  using accel::server::internal::HttpParseResult;
  using accel::server::internal::HttpRequestHead;
  const absl::string_view head(reinterpret_cast<const char*>(data), size);
  const HttpParseResult parsed = accel::server::internal::ParseHttpRequestHead(head, kMaxBody);
  if (const auto* error = std::get_if<HttpParseError>(&parsed)) {
    Check(error->status == 400 || error->status == 411 || error->status == 413 ||
          error->status == 431);
    Check(!error->message.empty());
    return 0;
  }
  const HttpRequestHead& request = std::get<HttpRequestHead>(parsed);
  Check(!request.method.empty());
  Check(!request.path.empty() && request.path[0] == '/');
  Check(request.path.find('?') == std::string::npos);
  Check(request.headers.size() <= accel::server::internal::kMaxHttpHeaders);
  for (const auto& [name, value] : request.headers) {
    Check(!name.empty());
    for (char c : name) {
      Check(!absl::ascii_isupper(static_cast<unsigned char>(c)));
      Check(absl::ascii_isgraph(static_cast<unsigned char>(c)) && c != ':');
    }
    Check(value.find_first_of(std::string("\r\n\0", 3)) == std::string::npos);
    Check(value.empty() || (!absl::ascii_isspace(static_cast<unsigned char>(value.front())) &&
                            !absl::ascii_isspace(static_cast<unsigned char>(value.back()))));
  }
  Check(request.content_length <= kMaxBody);
  Check(request.content_length == 0 || request.Header("content-length") != nullptr);
  if (const std::string* encoding = request.Header("transfer-encoding")) {
    Check(absl::EqualsIgnoreCase(*encoding, "identity"));
  }
  Check(!request.keep_alive || !request.http10 || request.Header("connection") != nullptr);
  return 0;
}
