// The paged decode attention kernels (models/cuda/attention_kernels.h) on a
// CUDA device against the plain double-precision reference of
// tests/models/paged_decode_reference.h, over the cases the host emulation
// checks (cuda_paged_decode_test.cc) and a few the emulation is too slow
// for: a 32k-token context split over many CTAs, a batch of 64 sequences,
// the plan's own partition for a real device. The argument checks run
// everywhere; without a CUDA device (cudaGetDeviceCount fails or finds none)
// every test that needs one is skipped.
#include <algorithm>
#include <cstdint>
#include <cuda_runtime_api.h>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "models/cuda/attention_kernels.h"
#include "tests/models/paged_decode_reference.h"

namespace accel::models::cuda {
namespace {

using models::testing::CompareDecode;
using models::testing::DecodeCase;
using models::testing::DecodeProblem;
using models::testing::KvDTypeName;
using models::testing::MakeDecodeProblem;

bool HasDevice() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it
    return false;
  }
  return count > 0;
}

#define ASSERT_CUDA_OK(expr)                                                    \
  do {                                                                          \
    const cudaError_t accel_status_ = (expr);                                   \
    ASSERT_EQ(accel_status_, cudaSuccess) << cudaGetErrorString(accel_status_); \
  } while (0)

class CudaAttentionKernelsTest : public ::testing::TestWithParam<DecodeCase> {
 protected:
  void SetUp() override {
    if (!HasDevice()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount)";
    ASSERT_CUDA_OK(cudaStreamCreate(&stream_));
    ASSERT_CUDA_OK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, 0));
  }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  template <typename T>
  T* Upload(const std::vector<T>& host) {
    void* p = nullptr;
    const size_t bytes = std::max<size_t>(host.size() * sizeof(T), 1);
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    allocations_.push_back(p);
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    return static_cast<T*>(p);
  }

  // Runs the kernels on `pr`; the output bytes.
  std::vector<uint8_t> Run(const DecodeProblem& pr) {
    std::vector<uint8_t> out(pr.out_elements() * static_cast<size_t>(pr.elem()), 0xff);  // NaN
    std::vector<float> workspace(static_cast<size_t>(
        PagedDecodeWorkspaceFloats(pr.seqs, pr.c.heads, pr.c.value_dim, pr.max_splits)));
    uint8_t* out_d = Upload(out);
    const PagedDecodeParams p =
        pr.Params(Upload(pr.q), Upload(pr.keys), Upload(pr.values), Upload(pr.tables),
                  Upload(pr.totals), out_d, workspace.empty() ? nullptr : Upload(workspace));
    const cudaError_t launched = PagedDecodeAttention(p, pr.c.dtype, stream_);
    EXPECT_EQ(launched, cudaSuccess) << cudaGetErrorString(launched);
    const cudaError_t done = cudaStreamSynchronize(stream_);
    EXPECT_EQ(done, cudaSuccess) << cudaGetErrorString(done);
    EXPECT_EQ(cudaMemcpy(out.data(), out_d, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

  cudaStream_t stream_ = nullptr;
  int sm_count_ = 0;
  std::vector<void*> allocations_;
};

TEST_P(CudaAttentionKernelsTest, MatchesTheReference) {
  DecodeCase c = GetParam();
  const DecodeProblem pr = MakeDecodeProblem(c, 11);
  std::string what;
  EXPECT_EQ(CompareDecode(pr, Run(pr), &what), 0)
      << KvDTypeName(c.dtype) << ", partition " << pr.partition << ", " << pr.max_splits
      << " splits\n"
      << what;
}

TEST_P(CudaAttentionKernelsTest, MatchesTheReferenceWithThePlansPartition) {
  // The partition a real step gets on this device (the occupancy rule).
  DecodeCase c = GetParam();
  const int32_t max_total = *std::max_element(c.totals.begin(), c.totals.end());
  c.partition =
      ChoosePagedPartition(static_cast<int32_t>(c.totals.size()), c.heads, c.kv_heads, c.head_dim,
                           c.value_dim, max_total, c.window, c.dtype, sm_count_);
  const DecodeProblem pr = MakeDecodeProblem(c, 12);
  std::string what;
  EXPECT_EQ(CompareDecode(pr, Run(pr), &what), 0)
      << KvDTypeName(c.dtype) << ", partition " << pr.partition << ", " << pr.max_splits
      << " splits\n"
      << what;
}

std::vector<DecodeCase> DeviceCases() {
  std::vector<DecodeCase> cases;
  auto add = [&](DecodeCase c) { cases.push_back(std::move(c)); };
  DecodeCase c;
  c = {};
  c.name = "Bf16Gqa";
  c.totals = {1, 7, 16, 17, 33, 70};
  add(c);
  c = {};
  c.name = "Fp16GqaSplits";
  c.dtype = KvDType::kFloat16;
  c.head_dim = c.value_dim = 128;
  c.totals = {1, 100, 300};
  c.partition = 64;
  add(c);
  c = {};
  c.name = "F32MqaWindowOddBlocks";
  c.dtype = KvDType::kFloat32;
  c.heads = 4;
  c.kv_heads = 1;
  c.block_size = 5;
  c.window = 37;
  c.totals = {3, 37, 38, 200};
  c.partition = 32;
  add(c);
  c = {};
  c.name = "Bf16SoftcapHead96";
  c.heads = c.kv_heads = 4;
  c.head_dim = c.value_dim = 96;
  c.softcap = 2.0f;
  c.totals = {20, 129};
  c.partition = 64;
  add(c);
  c = {};
  c.name = "Bf16Head256Splits";
  c.heads = 8;
  c.kv_heads = 4;
  c.head_dim = c.value_dim = 256;
  c.totals = {600, 5};
  c.partition = 128;
  add(c);
  c = {};
  c.name = "F32Values40";
  c.dtype = KvDType::kFloat32;
  c.heads = 2;
  c.kv_heads = 1;
  c.head_dim = c.value_dim = 40;
  c.totals = {50, 90};
  c.partition = 32;
  add(c);
  c = {};
  c.name = "Bf16Group12";
  c.heads = 12;
  c.kv_heads = 1;
  c.totals = {45, 2};
  add(c);
  // Llama-3-8B's attention: 32 heads over 8, 128 wide; a 32k context
  // (64 splits of 512), and a window inside it.
  c = {};
  c.name = "Bf16Llama8bLongContext";
  c.heads = 32;
  c.kv_heads = 8;
  c.head_dim = c.value_dim = 128;
  c.totals = {32768, 1};
  add(c);
  c.name = "Fp16Llama8bLongContextWindow";
  c.dtype = KvDType::kFloat16;
  c.window = 4096;
  add(c);
  // A batch of 64 sequences of mixed lengths.
  c = {};
  c.name = "Bf16Batch64";
  c.heads = 32;
  c.kv_heads = 8;
  c.head_dim = c.value_dim = 128;
  for (int32_t i = 0; i < 64; ++i) c.totals.push_back(1 + (i * 977) % 3000);
  add(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaAttentionKernelsTest, ::testing::ValuesIn(DeviceCases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) {
                           return info.param.name;
                         });

TEST(CudaAttentionKernelsArgumentsTest, BadParametersAreRefusedWithoutTouchingTheDevice) {
  PagedDecodeParams p;  // null pointers
  EXPECT_EQ(PagedDecodeAttention(p, KvDType::kBFloat16, nullptr), cudaErrorInvalidValue);
  alignas(16) static uint8_t bytes[4096];
  const int32_t one = 1;
  p.q = p.key_blocks = p.value_blocks = p.out = bytes;
  p.block_tables = p.totals = &one;
  p.num_blocks = 1;
  p.seqs = 1;
  p.heads = 3;
  p.kv_heads = 2;  // not a divisor
  p.block_size = 16;
  p.head_dim = p.value_dim = 64;
  p.table_stride = 1;
  p.partition = 64;
  EXPECT_EQ(PagedDecodeAttention(p, KvDType::kBFloat16, nullptr), cudaErrorInvalidValue);
  p.heads = 2;
  p.head_dim = 12;  // not a multiple of 8
  EXPECT_EQ(PagedDecodeAttention(p, KvDType::kBFloat16, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace accel::models::cuda
