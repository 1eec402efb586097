#include "server/internal/http_request_head.h"

#include <limits>
#include <optional>

#include <boost/asio/buffer.hpp>
#include <boost/beast/http/basic_parser.hpp>
#include <boost/beast/http/error.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace accel::server::internal {
namespace {

namespace http = boost::beast::http;
using boost::beast::error_code;

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

// The rules Beast does not apply (see the header), on the raw lines.
std::optional<HttpParseError> CheckLines(absl::string_view head) {
  if (HasStrayControl(head)) {
    return Error(400, "the request head has a NUL, or a CR or LF outside a CRLF line end");
  }
  size_t lines = 0;
  size_t start = 0;
  while (start <= head.size()) {
    size_t end = head.find("\r\n", start);
    if (end == absl::string_view::npos) end = head.size();
    const absl::string_view line = head.substr(start, end - start);
    if (lines > 0) {
      if (!line.empty() && (line[0] == ' ' || line[0] == '\t')) {
        return Error(400, "folded HTTP header line (obs-fold) is not accepted");
      }
      // Every Transfer-Encoding header, not just the first: a proxy may
      // read another of them.
      const size_t colon = line.find(':');
      if (colon != absl::string_view::npos &&
          absl::EqualsIgnoreCase(line.substr(0, colon), "transfer-encoding") &&
          !absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(line.substr(colon + 1)), "identity")) {
        return Error(411, "send the body with Content-Length (chunked bodies are not accepted)");
      }
    }
    ++lines;
    start = end + 2;
  }
  if (lines - 1 > kMaxHttpHeaders) {
    return Error(431, absl::StrCat("the request has ", lines - 1,
                                   " header lines, over this server's limit of ", kMaxHttpHeaders));
  }
  return std::nullopt;
}

// Beast's parser, collecting the head. The body is the transport's.
class HeadParser final : public http::basic_parser<true> {
 public:
  HttpRequestHead head;

 private:
  void on_request_impl(http::verb /*method*/, boost::beast::string_view method_text,
                       boost::beast::string_view target, int version, error_code& ec) override {
    if (version != 10 && version != 11) {
      ec = http::error::bad_version;
      return;
    }
    head.method.assign(method_text.data(), method_text.size());
    const absl::string_view path(target.data(), target.size());
    if (path.empty() || path[0] != '/') {
      ec = http::error::bad_target;
      return;
    }
    const size_t question = path.find('?');
    head.path = std::string(path.substr(0, question));
    if (question != absl::string_view::npos) head.query = std::string(path.substr(question + 1));
    head.http10 = version == 10;
  }

  void on_field_impl(http::field /*name*/, boost::beast::string_view name,
                     boost::beast::string_view value, error_code& /*ec*/) override {
    head.headers.emplace_back(
        absl::AsciiStrToLower(absl::string_view(name.data(), name.size())),
        std::string(absl::StripAsciiWhitespace(absl::string_view(value.data(), value.size()))));
  }

  // Never called for a request parser; Beast declares it for both kinds.
  void on_response_impl(int, boost::beast::string_view, int, error_code& ec) override {
    ec = http::error::bad_version;
  }

  void on_header_impl(error_code& /*ec*/) override {}
  // The body is not fed to this parser; say its length and stop.
  void on_body_init_impl(const boost::optional<std::uint64_t>& /*length*/,
                         error_code& /*ec*/) override {}
  std::size_t on_body_impl(boost::beast::string_view body, error_code& /*ec*/) override {
    return body.size();
  }
  void on_chunk_header_impl(std::uint64_t, boost::beast::string_view, error_code& ec) override {
    ec = http::error::bad_transfer_encoding;  // refused before (CheckLines)
  }
  std::size_t on_chunk_body_impl(std::uint64_t, boost::beast::string_view,
                                 error_code& ec) override {
    ec = http::error::bad_transfer_encoding;
    return 0;
  }
  void on_finish_impl(error_code& /*ec*/) override {}
};

HttpParseError FromBeast(const error_code& ec) {
  if (ec == http::error::header_limit) {
    return Error(431, "the request head is over this server's limit");
  }
  if (ec == http::error::bad_content_length) {
    return Error(400, "Content-Length is not a number, or Content-Length headers conflict");
  }
  if (ec == http::error::bad_transfer_encoding) {
    return Error(411, "send the body with Content-Length (chunked bodies are not accepted)");
  }
  if (ec == http::error::bad_field) {
    return Error(400, "malformed HTTP header name (a token: no spaces or control characters)");
  }
  if (ec == http::error::bad_value) return Error(400, "malformed HTTP header value");
  // bad_method, bad_target, bad_version, bad_line_ending, partial_message
  // (a head that ends inside its request line).
  return Error(400, "malformed HTTP request line");
}

}  // namespace

const std::string* HttpRequestHead::Header(absl::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return &value;
  }
  return nullptr;
}

HttpParseResult ParseHttpRequestHead(absl::string_view head, uint64_t max_body_bytes) {
  if (std::optional<HttpParseError> refused = CheckLines(head)) return *std::move(refused);
  HeadParser parser;
  // The transport bounds the head's size; Beast's own cap is off here.
  parser.header_limit(static_cast<std::uint32_t>(head.size() + 4));
  // Ours is checked below, with our message. (Not boost::none: Beast 1.74
  // compares the length with the optional itself, and none is below every
  // length, so it would refuse every body.)
  parser.body_limit(std::numeric_limits<std::uint64_t>::max());
  parser.eager(false);
  const std::string framed = absl::StrCat(head, "\r\n\r\n");
  error_code ec;
  const size_t used = parser.put(boost::asio::buffer(framed.data(), framed.size()), ec);
  if (!ec && !parser.is_header_done()) ec = http::error::partial_message;
  if (ec) return FromBeast(ec);
  // The head ended before the blank line we put after it: it held one of its
  // own (an empty header line).
  if (used != framed.size()) return Error(400, "malformed HTTP header line");
  HttpRequestHead request = std::move(parser.head);
  if (const boost::optional<std::uint64_t> length = parser.content_length()) {
    request.content_length = *length;
  }
  if (request.content_length > max_body_bytes) {
    return Error(413,
                 absl::StrCat("the body is ", request.content_length,
                              " bytes, over this server's limit of ", max_body_bytes, " bytes"));
  }
  request.keep_alive = parser.keep_alive();
  if (const std::string* expect = request.Header("expect")) {
    request.expect_continue = absl::EqualsIgnoreCase(*expect, "100-continue");
  }
  return request;
}

}  // namespace accel::server::internal
