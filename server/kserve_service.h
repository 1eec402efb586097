// server/kserve_service.h: the KServe v2 / Open Inference Protocol gRPC
// service (inference.GRPCInferenceService, proto/inference/grpc_service.proto)
// on gRPC's callback API, so KServe, Triton and Seldon clients can use
// accel-serve unchanged.
//
//   accel::server::KServeService kserve(&state, "0.1.0");
//   builder.RegisterService(&kserve);
//
// The LLM conventions (tensor names, sampling parameters, raw vs typed
// contents) are in server/internal/kserve_convert.h. ModelInfer answers
// once per request (N text_input elements run concurrently); ModelStreamInfer follows Triton's
// decoupled convention: a response per decode step, the last one flagged triton_final_response,
// errors in-band in error_message.
//
// Thread-safe: gRPC calls the handlers from its threads; they never block.
#ifndef ACCEL_SERVER_KSERVE_SERVICE_H_
#define ACCEL_SERVER_KSERVE_SERVICE_H_

#include <string>

#include "inference/grpc_service.grpc.pb.h"
#include "server/serving.h"

namespace accel::server {

// gRPC's callback service with every method raw (a raw method cannot sit
// on top of the typed bidi one: same parameters).
using KServeServiceBase = inference::GRPCInferenceService::WithRawCallbackMethod_ServerLive<
    inference::GRPCInferenceService::WithRawCallbackMethod_ServerReady<
        inference::GRPCInferenceService::WithRawCallbackMethod_ModelReady<
            inference::GRPCInferenceService::WithRawCallbackMethod_ServerMetadata<
                inference::GRPCInferenceService::WithRawCallbackMethod_ModelMetadata<
                    inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
                        inference::GRPCInferenceService::WithRawCallbackMethod_ModelStreamInfer<
                            inference::GRPCInferenceService::Service>>>>>>>;

// Every method is raw (grpc::ByteBuffer in and out) and parses its request
// itself (server/internal/wire.h), so a body that does not parse is
// INVALID_ARGUMENT naming the problem rather than gRPC's bare UNIMPLEMENTED.
class KServeService final : public KServeServiceBase {
 public:
  // `state` outlives the service; `server_version` is what ServerMetadata reports.
  KServeService(ServingState* state, std::string server_version);

  // Always live: the process answers. No authentication (probes call it).
  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  // Ready once the model is loaded and until draining. No authentication.
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  // NOT_FOUND for a name other than the served one (or a version other than
  // "" or "1"); ready=false for any name while the model loads.
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  // UNAVAILABLE while the model loads; NOT_FOUND as in ModelReady.
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override;

 private:
  // The typed answers behind the raw methods.
  grpc::Status AnswerServerLive(grpc::CallbackServerContext* context,
                                const inference::ServerLiveRequest* request,
                                inference::ServerLiveResponse* response);
  grpc::Status AnswerServerReady(grpc::CallbackServerContext* context,
                                 const inference::ServerReadyRequest* request,
                                 inference::ServerReadyResponse* response);
  grpc::Status AnswerModelReady(grpc::CallbackServerContext* context,
                                const inference::ModelReadyRequest* request,
                                inference::ModelReadyResponse* response);
  grpc::Status AnswerServerMetadata(grpc::CallbackServerContext* context,
                                    const inference::ServerMetadataRequest* request,
                                    inference::ServerMetadataResponse* response);
  grpc::Status AnswerModelMetadata(grpc::CallbackServerContext* context,
                                   const inference::ModelMetadataRequest* request,
                                   inference::ModelMetadataResponse* response);

  ServingState* const state_;
  const std::string server_version_;
};

}  // namespace accel::server

#endif  // ACCEL_SERVER_KSERVE_SERVICE_H_
