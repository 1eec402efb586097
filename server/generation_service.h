// server/generation_service.h: accel.v1.Generation (proto/accel/v1/
// generation.proto) on gRPC's callback API. Handlers validate through the
// Engine and return at once; the scheduler thread answers through a sink.
#ifndef ACCEL_SERVER_GENERATION_SERVICE_H_
#define ACCEL_SERVER_GENERATION_SERVICE_H_

#include "accel/v1/generation.grpc.pb.h"
#include "server/serving.h"

namespace accel::server {

class GenerationService final : public accel::v1::Generation::CallbackService {
 public:
  explicit GenerationService(ServingState* state) : state_(state) {}

  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* context,
                                     const accel::v1::GenerateRequest* request,
                                     accel::v1::GenerateResponse* response) override;
  grpc::ServerWriteReactor<accel::v1::GenerateResponse>* GenerateStream(
      grpc::CallbackServerContext* context, const accel::v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const accel::v1::GetModelInfoRequest* request,
                                         accel::v1::ModelInfo* response) override;

 private:
  ServingState* const state_;
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_GENERATION_SERVICE_H_
