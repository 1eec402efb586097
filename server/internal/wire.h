// server/internal/wire.h: request and response bodies as raw bytes, for the
// handlers that parse their requests themselves.
//
// Why: gRPC C++ (1.51, server_callback_handlers.h) answers a request whose
// body does not parse as its message type with UNIMPLEMENTED and an empty
// message, whatever the reason; the typed handler never sees the call. A
// proto3 `string` field holding invalid UTF-8 (say a prompt cut in the middle
// of a character) is such a body. So the generation handlers are registered
// as raw methods (grpc::ByteBuffer in and out) and parse here, which lets
// them answer INVALID_ARGUMENT naming the problem.
#ifndef ACCEL_SERVER_INTERNAL_WIRE_H_
#define ACCEL_SERVER_INTERNAL_WIRE_H_

#include <string>

#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace google::protobuf {
class Message;
}

namespace accel::server::internal {

// Parses `body` into `message`. InvalidArgument when it does not parse,
// naming the message type and, for a string field holding bytes that are
// not UTF-8, the field ("field accel.v1.GenerateRequest.prompt is not valid
// UTF-8 ...").
absl::Status ParseBody(const grpc::ByteBuffer& body, google::protobuf::Message& message);

// `message` serialized into a ByteBuffer to write.
grpc::ByteBuffer SerializeBody(const google::protobuf::Message& message);

// A typed unary answer behind a raw method: parses `body` as a Request
// (INVALID_ARGUMENT naming the problem when it does not parse), runs
// `answer(request, &response)` and sends the response when that is OK.
template <typename Request, typename Response, typename Answer>
grpc::ServerUnaryReactor* AnswerRaw(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer& body, grpc::ByteBuffer* out,
                                    Answer answer) {
  Request request;
  Response response;
  const absl::Status parsed = ParseBody(body, request);
  grpc::Status status =
      parsed.ok() ? answer(request, &response)
                  : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(parsed.message()));
  if (status.ok()) *out = SerializeBody(response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_WIRE_H_
