#include "server/internal/wire.h"

#include <string>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/support/slice.h>

#include "absl/strings/str_cat.h"

#include "tokenizer/tokenizer.h"

namespace accel::server::internal {
namespace {

// The first string field under `type` in the wire fields `fields` whose
// bytes are not UTF-8, as "pkg.Message.field"; empty when there is none.
// Walks nested messages (a message field's bytes are parsed as fields
// again), so it finds a bad tensor name inside a KServe request too.
std::string FindBadUtf8(const google::protobuf::Descriptor& type,
                        const google::protobuf::UnknownFieldSet& fields, int depth) {
  if (depth > 32) return "";
  for (int i = 0; i < fields.field_count(); ++i) {
    const google::protobuf::UnknownField& field = fields.field(i);
    if (field.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) continue;
    const google::protobuf::FieldDescriptor* descriptor = type.FindFieldByNumber(field.number());
    if (descriptor == nullptr) continue;
    if (descriptor->type() == google::protobuf::FieldDescriptor::TYPE_STRING) {
      if (!tokenizer::IsValidUtf8(field.length_delimited())) return descriptor->full_name();
    } else if (descriptor->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
      google::protobuf::UnknownFieldSet inner;
      if (!inner.ParseFromString(field.length_delimited())) continue;
      std::string bad = FindBadUtf8(*descriptor->message_type(), inner, depth + 1);
      if (!bad.empty()) return bad;
    }
  }
  return "";
}

}  // namespace

absl::Status ParseBody(const grpc::ByteBuffer& body, google::protobuf::Message& message) {
  std::vector<grpc::Slice> slices;
  if (!body.Dump(&slices).ok()) return absl::InvalidArgumentError("the request body is unreadable");
  std::string bytes;
  bytes.reserve(body.Length());
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  {
    // protobuf logs every invalid UTF-8 string it meets at ERROR; a client
    // could fill the server's log that way. The answer says it instead.
    google::protobuf::LogSilencer quiet;
    if (message.ParseFromString(bytes)) return absl::OkStatus();
  }
  const std::string type = message.GetDescriptor()->full_name();
  google::protobuf::UnknownFieldSet fields;
  if (fields.ParseFromString(bytes)) {
    const std::string bad = FindBadUtf8(*message.GetDescriptor(), fields, 0);
    if (!bad.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", bad, " is not valid UTF-8; protobuf string fields must be UTF-8 text"));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("the request body (", bytes.size(),
                                                 " bytes) is not a valid ", type, " message"));
}

grpc::ByteBuffer SerializeBody(const google::protobuf::Message& message) {
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace accel::server::internal
