#include "server/internal/http_parse.h"

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace accel::server::internal {
namespace {

// RFC 9110 5.6.2: tchar.
bool IsTokenChar(char c) {
  if (absl::ascii_isalnum(static_cast<unsigned char>(c))) return true;
  switch (c) {
    case '!':
    case '#':
    case '$':
    case '%':
    case '&':
    case '\'':
    case '*':
    case '+':
    case '-':
    case '.':
    case '^':
    case '_':
    case '`':
    case '|':
    case '~':
      return true;
    default:
      return false;
  }
}

bool IsToken(absl::string_view text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (!IsTokenChar(c)) return false;
  }
  return true;
}

// A CR not followed by LF, an LF not after a CR, or a NUL.
bool HasStrayControl(absl::string_view head) {
  for (size_t i = 0; i < head.size(); ++i) {
    const char c = head[i];
    if (c == '\0') return true;
    if (c == '\r' && (i + 1 == head.size() || head[i + 1] != '\n')) return true;
    if (c == '\n' && (i == 0 || head[i - 1] != '\r')) return true;
  }
  return false;
}

HttpParseError Error(int status, std::string message) {
  return HttpParseError{status, std::move(message)};
}

}  // namespace

const std::string* HttpRequestHead::Header(absl::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return &value;
  }
  return nullptr;
}

HttpParseResult ParseHttpRequestHead(absl::string_view head, uint64_t max_body_bytes) {
  if (HasStrayControl(head)) {
    return Error(400, "the request head has a NUL, or a CR or LF outside a CRLF line end");
  }
  const std::vector<absl::string_view> lines = absl::StrSplit(head, "\r\n");
  const std::vector<absl::string_view> start = absl::StrSplit(lines[0], ' ');
  if (start.size() != 3 || !IsToken(start[0]) || start[1].empty() || start[1][0] != '/' ||
      !absl::StartsWith(start[2], "HTTP/1.")) {
    return Error(400, "malformed HTTP request line");
  }
  if (lines.size() - 1 > kMaxHttpHeaders) {
    return Error(431, absl::StrCat("the request has ", lines.size() - 1,
                                   " header lines, over this server's limit of ", kMaxHttpHeaders));
  }
  HttpRequestHead request;
  request.method = std::string(start[0]);
  const size_t question = start[1].find('?');
  request.path = std::string(start[1].substr(0, question));
  if (question != absl::string_view::npos) {
    request.query = std::string(start[1].substr(question + 1));
  }
  request.http10 = start[2] == "HTTP/1.0";
  request.headers.reserve(lines.size() - 1);
  for (size_t i = 1; i < lines.size(); ++i) {
    const absl::string_view line = lines[i];
    if (!line.empty() && (line[0] == ' ' || line[0] == '\t')) {
      return Error(400, "folded HTTP header line (obs-fold) is not accepted");
    }
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos || colon == 0) {
      return Error(400, "malformed HTTP header line");
    }
    const absl::string_view name = line.substr(0, colon);
    if (!IsToken(name)) {
      return Error(400, "malformed HTTP header name (a token: no spaces or control characters)");
    }
    request.headers.emplace_back(absl::AsciiStrToLower(name),
                                 std::string(absl::StripAsciiWhitespace(line.substr(colon + 1))));
  }
  // Every Transfer-Encoding header, not just the first: a proxy may read
  // another of them.
  for (const auto& [name, value] : request.headers) {
    if (name == "transfer-encoding" && !absl::EqualsIgnoreCase(value, "identity")) {
      return Error(411, "send the body with Content-Length (chunked bodies are not accepted)");
    }
  }
  bool seen_length = false;
  for (const auto& [name, value] : request.headers) {
    if (name != "content-length") continue;
    uint64_t parsed = 0;
    // Digits only (SimpleAtoi alone would take "+5"); overflow fails SimpleAtoi.
    if (value.empty() || value.find_first_not_of("0123456789") != std::string::npos ||
        !absl::SimpleAtoi(value, &parsed)) {
      return Error(400, "Content-Length is not a number");
    }
    if (!seen_length) {
      seen_length = true;
      request.content_length = parsed;
    } else if (parsed != request.content_length) {
      return Error(400, "conflicting Content-Length headers");
    }
  }
  if (request.content_length > max_body_bytes) {
    return Error(413,
                 absl::StrCat("the body is ", request.content_length,
                              " bytes, over this server's limit of ", max_body_bytes, " bytes"));
  }
  request.keep_alive = !request.http10;
  if (const std::string* connection = request.Header("connection")) {
    if (absl::EqualsIgnoreCase(*connection, "close")) request.keep_alive = false;
    if (request.http10 && absl::EqualsIgnoreCase(*connection, "keep-alive")) {
      request.keep_alive = true;
    }
  }
  if (const std::string* expect = request.Header("expect")) {
    request.expect_continue = absl::EqualsIgnoreCase(*expect, "100-continue");
  }
  return request;
}

}  // namespace accel::server::internal
