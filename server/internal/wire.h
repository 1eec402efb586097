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

#include <grpcpp/support/byte_buffer.h>

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

}  // namespace accel::server::internal

#endif  // ACCEL_SERVER_INTERNAL_WIRE_H_
