// accel-bench-offload's decode rows (offload_decode.cc says what they measure).
#ifndef ACCEL_BENCH_MODELS_OFFLOAD_DECODE_H_
#define ACCEL_BENCH_MODELS_OFFLOAD_DECODE_H_

#include <cstdint>
#include <string>

namespace accel::bench {

struct DecodeRowsOptions {
  std::string dir = "/tmp/accel-bench-offload-decode";  // the model, made there once
  int layers = 18;
  int64_t hidden = 1024;
  int tokens = 16;  // decode steps timed per row
};

int DecodeRows(const DecodeRowsOptions& options);

}  // namespace accel::bench

#endif  // ACCEL_BENCH_MODELS_OFFLOAD_DECODE_H_
