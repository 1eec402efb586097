// loader/tensor_info.h: one tensor as a safetensors header describes it.
// Torch-free, so the header parser (and its fuzz target) need no libtorch.
#ifndef ACCEL_LOADER_TENSOR_INFO_H_
#define ACCEL_LOADER_TENSOR_INFO_H_

#include <cstdint>
#include <string>
#include <vector>

namespace accel::loader {

// One tensor as a safetensors header describes it.
struct TensorInfo {
  std::string name;
  std::string dtype;  // safetensors spelling: "F32", "BF16", "I64", "BOOL", ...
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // byte offsets within the file's data section
  uint64_t data_end = 0;

  uint64_t nbytes() const { return data_end - data_begin; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

}  // namespace accel::loader

#endif  // ACCEL_LOADER_TENSOR_INFO_H_
