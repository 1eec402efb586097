// Test helpers for accel.v1.Generation clients: a greedy request that runs
// its whole length, and a unary call with a deadline.
#ifndef ACCEL_TESTS_SERVER_GENERATION_CLIENT_H_
#define ACCEL_TESTS_SERVER_GENERATION_CLIENT_H_

#include <cstdint>
#include <string>

#include <grpcpp/client_context.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "accel/v1/generation.grpc.pb.h"

namespace accel::testing {

inline accel::v1::GenerateRequest Greedy(const std::string& prompt, int64_t max_new_tokens) {
  accel::v1::GenerateRequest request;
  request.set_prompt(prompt);
  request.set_max_new_tokens(max_new_tokens);
  request.set_ignore_eos(true);
  return request;
}

inline grpc::Status Call(accel::v1::Generation::Stub& stub,
                         const accel::v1::GenerateRequest& request,
                         accel::v1::GenerateResponse* response,
                         absl::Duration timeout = absl::Seconds(60)) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return stub.Generate(&context, request, response);
}

}  // namespace accel::testing

#endif  // ACCEL_TESTS_SERVER_GENERATION_CLIENT_H_
