// core/float16_bits.h: bfloat16 and IEEE float16 as 16-bit patterns, with
// exact widening to float32 and round-to-nearest-even narrowing (the
// rounding of at::Tensor::to and of CUDA's __float2bfloat16_rn /
// __float2half_rn). Torch-free and CUDA-free: under nvcc the functions are
// host + device (device code uses the hardware conversions where they
// exist), so kernels written as host + device code (quant/cuda/internal,
// models/cuda/internal) convert the same way on a machine without a GPU.
#ifndef ACCEL_CORE_FLOAT16_BITS_H_
#define ACCEL_CORE_FLOAT16_BITS_H_

#include <cstdint>
#include <cstring>
#include <math.h>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define ACCEL_HD __host__ __device__ __forceinline__
#else
#define ACCEL_HD inline
#endif

namespace accel::float16_bits {

ACCEL_HD float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

ACCEL_HD uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

ACCEL_HD float BFloat16ToFloat(uint16_t v) { return BitsToFloat(static_cast<uint32_t>(v) << 16); }

ACCEL_HD uint16_t FloatToBFloat16(float v) {
  const uint32_t x = FloatToBits(v);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

ACCEL_HD float HalfToFloat(uint16_t v) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(v));
#else
  const uint32_t sign = static_cast<uint32_t>(v & 0x8000u) << 16;
  const uint32_t exponent = (v >> 10) & 0x1fu, mantissa = v & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}

ACCEL_HD uint16_t FloatToHalf(float v) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(v));
#else
  const uint32_t x = FloatToBits(v);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity
  if (ax < 0x38800000u) {                        // below 2^-14: a multiple of 2^-24
    return sign | static_cast<uint16_t>(nearbyintf(BitsToFloat(ax) * 16777216.0f));
  }
  uint32_t h = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
#endif
}

}  // namespace accel::float16_bits

#endif  // ACCEL_CORE_FLOAT16_BITS_H_
