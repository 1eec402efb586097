// server/generation_service.h: accel.v1.Generation (proto/accel/v1/
// generation.proto) on gRPC's callback API. Handlers validate through the
// Engine and return at once; the scheduler thread answers through a sink.
#ifndef ACCEL_SERVER_GENERATION_SERVICE_H_
#define ACCEL_SERVER_GENERATION_SERVICE_H_

#include <string>
#include <utility>

#include "accel/v1/generation.grpc.pb.h"
#include "server/serving.h"

namespace accel::server {

// Every method is raw (grpc::ByteBuffer in and out) and parses its request
// itself (server/internal/wire.h), so a body
// that does not parse is INVALID_ARGUMENT naming the problem rather than
// gRPC's bare UNIMPLEMENTED.
class GenerationService final
    : public accel::v1::Generation::WithRawCallbackMethod_Generate<
          accel::v1::Generation::WithRawCallbackMethod_GenerateStream<
              accel::v1::Generation::WithRawCallbackMethod_Chat<
                  accel::v1::Generation::WithRawCallbackMethod_ChatStream<
                      accel::v1::Generation::WithRawCallbackMethod_GetModelInfo<
                          accel::v1::Generation::Service>>>>> {
 public:
  // `tool_call_parser`: --tool_call_parser (hermes | llama3_json | mistral |
  // none | auto), for Chat's tool_choice and tool_calls.
  explicit GenerationService(ServingState* state, std::string tool_call_parser = "auto")
      : state_(state), tool_call_parser_(std::move(tool_call_parser)) {}

  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerateStream(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* Chat(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* ChatStream(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;

 private:
  grpc::Status AnswerGetModelInfo(grpc::CallbackServerContext& context,
                                  accel::v1::ModelInfo* response);

  ServingState* const state_;
  const std::string tool_call_parser_;
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_GENERATION_SERVICE_H_
