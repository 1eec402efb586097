// The request-head parser: Boost.Beast's parser under our rules against
// request smuggling and header injection (server/internal/http_request_head.h).
#include "server/internal/http_request_head.h"

#include <string>
#include <variant>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace accel::server::internal {
namespace {

using ::testing::HasSubstr;
using ::testing::Pair;

constexpr uint64_t kMaxBody = 4 << 20;

HttpRequestHead ParseOk(const std::string& head, uint64_t max_body = kMaxBody) {
  HttpParseResult parsed = ParseHttpRequestHead(head, max_body);
  if (const auto* error = std::get_if<HttpParseError>(&parsed)) {
    ADD_FAILURE() << "refused (" << error->status << ": " << error->message << "): " << head;
    return HttpRequestHead();
  }
  return std::get<HttpRequestHead>(std::move(parsed));
}

HttpParseError ParseError(const std::string& head, uint64_t max_body = kMaxBody) {
  HttpParseResult parsed = ParseHttpRequestHead(head, max_body);
  if (!std::holds_alternative<HttpParseError>(parsed)) {
    ADD_FAILURE() << "accepted: " << head;
    return HttpParseError{0, ""};
  }
  return std::get<HttpParseError>(std::move(parsed));
}

TEST(HttpRequestHeadTest, RequestLineAndHeaders) {
  const HttpRequestHead head = ParseOk(
      "POST /v1/chat/completions?a=1&b=2 HTTP/1.1\r\nHost: localhost:8000\r\n"
      "Content-Type:  application/json \r\nX-Empty:\r\nContent-Length: 12");
  EXPECT_EQ(head.method, "POST");
  EXPECT_EQ(head.path, "/v1/chat/completions");
  EXPECT_EQ(head.query, "a=1&b=2");
  EXPECT_FALSE(head.http10);
  EXPECT_TRUE(head.keep_alive);
  EXPECT_EQ(head.content_length, 12u);
  EXPECT_FALSE(head.expect_continue);
  EXPECT_THAT(head.headers,
              ::testing::ElementsAre(Pair("host", "localhost:8000"),
                                     Pair("content-type", "application/json"), Pair("x-empty", ""),
                                     Pair("content-length", "12")));
  ASSERT_NE(head.Header("content-type"), nullptr);
  EXPECT_EQ(*head.Header("content-type"), "application/json");
  EXPECT_EQ(head.Header("Content-Type"), nullptr);  // names are looked up lower-case
  EXPECT_EQ(head.Header("accept"), nullptr);
}

TEST(HttpRequestHeadTest, NoHeadersNoBody) {
  const HttpRequestHead head = ParseOk("GET / HTTP/1.1");
  EXPECT_EQ(head.path, "/");
  EXPECT_EQ(head.query, "");
  EXPECT_TRUE(head.headers.empty());
  EXPECT_EQ(head.content_length, 0u);
  // Only the first '?' splits.
  EXPECT_EQ(ParseOk("GET /a?b?c HTTP/1.1").query, "b?c");
  // The first of two headers of a name.
  EXPECT_EQ(*ParseOk("GET / HTTP/1.1\r\nA: 1\r\na: 2").Header("a"), "1");
}

TEST(HttpRequestHeadTest, MalformedRequestLine) {
  for (const char* head :
       {"", "GET", "GET /", "GET / HTTP/1.1 x", "GET  / HTTP/1.1", " GET / HTTP/1.1",
        "GET x HTTP/1.1", "GET / HTTP/2.0", "GET / http/1.1", "GET / HTTP/1.1 ", "G(T / HTTP/1.1",
        "G\x7fT / HTTP/1.1", "GET\t/ HTTP/1.1"}) {
    const HttpParseError error = ParseError(head);
    EXPECT_EQ(error.status, 400) << head;
    EXPECT_EQ(error.message, "malformed HTTP request line") << head;
  }
}

TEST(HttpRequestHeadTest, MalformedHeaderLine) {
  for (const char* head :
       {"GET / HTTP/1.1\r\nNoColon", "GET / HTTP/1.1\r\n: value", "GET / HTTP/1.1\r\nA: b\r\n"}) {
    const HttpParseError error = ParseError(head);
    EXPECT_EQ(error.status, 400) << head;
    EXPECT_THAT(error.message, HasSubstr("malformed HTTP header")) << head;
  }
}

TEST(HttpRequestHeadTest, HeaderNamesAreTokens) {
  // A space before the colon (RFC 9112 5.1: must be refused), inside the
  // name, control characters, separators.
  for (const char* head :
       {"GET / HTTP/1.1\r\nContent-Length : 5", "GET / HTTP/1.1\r\nContent Length: 5",
        "GET / HTTP/1.1\r\nA\tB: 1", "GET / HTTP/1.1\r\nA\x01: 1", "GET / HTTP/1.1\r\nA\x7f: 1",
        "GET / HTTP/1.1\r\n(a): 1", "GET / HTTP/1.1\r\na/b: 1", "GET / HTTP/1.1\r\na\xc3\xa9: 1"}) {
    const HttpParseError error = ParseError(head);
    EXPECT_EQ(error.status, 400) << head;
    EXPECT_THAT(error.message, HasSubstr("header name")) << head;
  }
  EXPECT_EQ(ParseOk("GET / HTTP/1.1\r\nX-A_b.c~!#$%&'*+^`|9: v").headers[0].first,
            "x-a_b.c~!#$%&'*+^`|9");
}

TEST(HttpRequestHeadTest, ObsFoldIsRefused) {
  for (const char* head : {"GET / HTTP/1.1\r\nA: 1\r\n folded", "GET / HTTP/1.1\r\nA: 1\r\n\tb: 2",
                           "GET / HTTP/1.1\r\n Transfer-Encoding: chunked"}) {
    const HttpParseError error = ParseError(head);
    EXPECT_EQ(error.status, 400) << head;
    EXPECT_THAT(error.message, HasSubstr("obs-fold")) << head;
  }
}

TEST(HttpRequestHeadTest, BareCrLfAndNulAreRefused) {
  using namespace std::string_literals;
  for (const std::string& head :
       {"GET / HTTP/1.1\r\nA: b\nTransfer-Encoding: chunked"s,
        "GET / HTTP/1.1\r\nA: b\rTransfer-Encoding: chunked"s, "GET / HTTP/1.1\nA: b"s,
        "GET / HTTP/1.1\r\nA: b\r"s, "\nGET / HTTP/1.1"s, "GET / HTTP/1.1\r\nA: b\0c"s,
        "GET /\0 HTTP/1.1"s, "GET / HTTP/1.1\r\nA\0: b"s, "GET / HTTP/1.1\r"s}) {
    const HttpParseError error = ParseError(head);
    EXPECT_EQ(error.status, 400) << head;
    EXPECT_THAT(error.message, HasSubstr("NUL")) << head;
  }
}

TEST(HttpRequestHeadTest, HeaderCountIsCapped) {
  std::string head = "GET / HTTP/1.1";
  for (size_t i = 0; i < kMaxHttpHeaders; ++i) absl::StrAppend(&head, "\r\nX-", i, ": v");
  EXPECT_EQ(ParseOk(head).headers.size(), kMaxHttpHeaders);
  absl::StrAppend(&head, "\r\nX-last: v");
  const HttpParseError error = ParseError(head);
  EXPECT_EQ(error.status, 431);
  EXPECT_THAT(error.message, HasSubstr("101 header lines"));
}

TEST(HttpRequestHeadTest, TransferEncoding) {
  EXPECT_EQ(
      ParseOk("POST / HTTP/1.1\r\nTransfer-Encoding: IDENTITY\r\nContent-Length: 3").content_length,
      3u);
  for (const char* head : {"POST / HTTP/1.1\r\nTransfer-Encoding: chunked",
                           "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3",
                           "POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked",
                           "POST / HTTP/1.1\r\nTransfer-Encoding: identity, chunked",
                           // Not only the first Transfer-Encoding header counts.
                           "POST / HTTP/1.1\r\nTransfer-Encoding: identity\r\nContent-Length: 3\r\n"
                           "Transfer-Encoding: chunked"}) {
    const HttpParseError error = ParseError(head);
    EXPECT_EQ(error.status, 411) << head;
    EXPECT_EQ(error.message, "send the body with Content-Length (chunked bodies are not accepted)");
  }
}

TEST(HttpRequestHeadTest, ContentLength) {
  EXPECT_EQ(ParseOk("POST / HTTP/1.1\r\nContent-Length: 0").content_length, 0u);
  EXPECT_EQ(ParseOk("POST / HTTP/1.1\r\ncontent-length:\t007 ").content_length, 7u);
  EXPECT_EQ(ParseOk("POST / HTTP/1.1\r\nContent-Length: 4194304").content_length, kMaxBody);
  // The same value twice is one length.
  EXPECT_EQ(ParseOk("POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5").content_length,
            5u);
  for (const char* head :
       {"POST / HTTP/1.1\r\nContent-Length: ", "POST / HTTP/1.1\r\nContent-Length: x",
        "POST / HTTP/1.1\r\nContent-Length: -1", "POST / HTTP/1.1\r\nContent-Length: +5",
        "POST / HTTP/1.1\r\nContent-Length: 5 5", "POST / HTTP/1.1\r\nContent-Length: 5, 6",
        "POST / HTTP/1.1\r\nContent-Length: 0x10", "POST / HTTP/1.1\r\nContent-Length: 1e3",
        // 2^64: over uint64.
        "POST / HTTP/1.1\r\nContent-Length: 18446744073709551616",
        "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999999",
        // Not only the first Content-Length header is checked.
        "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: five"}) {
    const HttpParseError error = ParseError(head);
    EXPECT_EQ(error.status, 400) << head;
    EXPECT_THAT(error.message, HasSubstr("Content-Length")) << head;
  }
  const HttpParseError conflict =
      ParseError("POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 50");
  EXPECT_EQ(conflict.status, 400);
  EXPECT_THAT(conflict.message, HasSubstr("Content-Length headers conflict"));
  // A list of one value repeated is that value (RFC 9110 8.6), as Beast reads it.
  EXPECT_EQ(ParseOk("POST / HTTP/1.1\r\nContent-Length: 5, 5").content_length, 5u);
}

TEST(HttpRequestHeadTest, ContentLengthOverTheLimit) {
  const HttpParseError error = ParseError("POST / HTTP/1.1\r\nContent-Length: 4194305");
  EXPECT_EQ(error.status, 413);
  EXPECT_EQ(error.message, "the body is 4194305 bytes, over this server's limit of 4194304 bytes");
  EXPECT_EQ(ParseError("POST / HTTP/1.1\r\nContent-Length: 18446744073709551615").status, 413);
  EXPECT_EQ(ParseError("POST / HTTP/1.1\r\nContent-Length: 11", 10).status, 413);
  EXPECT_EQ(ParseOk("POST / HTTP/1.1\r\nContent-Length: 10", 10).content_length, 10u);
}

TEST(HttpRequestHeadTest, KeepAlive) {
  EXPECT_TRUE(ParseOk("GET / HTTP/1.1").keep_alive);
  EXPECT_FALSE(ParseOk("GET / HTTP/1.1\r\nConnection: Close").keep_alive);
  EXPECT_TRUE(ParseOk("GET / HTTP/1.1\r\nConnection: keep-alive").keep_alive);
  const HttpRequestHead http10 = ParseOk("GET / HTTP/1.0");
  EXPECT_TRUE(http10.http10);
  EXPECT_FALSE(http10.keep_alive);
  EXPECT_TRUE(ParseOk("GET / HTTP/1.0\r\nConnection: Keep-Alive").keep_alive);
  EXPECT_FALSE(ParseOk("GET / HTTP/1.0\r\nConnection: close").keep_alive);
  // HTTP/1.0 and 1.1 only.
  EXPECT_EQ(ParseError("GET / HTTP/1.9").status, 400);
}

TEST(HttpRequestHeadTest, ExpectContinue) {
  EXPECT_TRUE(
      ParseOk("POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 3").expect_continue);
  EXPECT_FALSE(ParseOk("POST / HTTP/1.1\r\nExpect: something").expect_continue);
}

}  // namespace
}  // namespace accel::server::internal
