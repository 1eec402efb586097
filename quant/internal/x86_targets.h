// Target attributes for the x86 kernels of quant/internal: each function
// carries its own, so the library builds for plain x86-64 and picks a level
// at run time (kernels_cpu.h).
#ifndef ACCEL_QUANT_INTERNAL_X86_TARGETS_H_
#define ACCEL_QUANT_INTERNAL_X86_TARGETS_H_

#include "core/x86_intrinsics.h"

#if defined(__x86_64__)
#define ACCEL_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ACCEL_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")))
#define ACCEL_TARGET_AVX512_BF16 \
  __attribute__((                \
      target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx512bf16,avx2,fma,f16c")))
#endif  // __x86_64__

#define ACCEL_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__)
namespace accel::quant::internal {

// 16 float32 values kept from being fused with the next operation
// (kernels_cpu.h's Unfused, for a register).
ACCEL_TARGET_AVX512 ACCEL_INLINE void Unfused(__m512& v) { asm("" : "+v"(v)); }

}  // namespace accel::quant::internal
#endif  // __x86_64__

#endif  // ACCEL_QUANT_INTERNAL_X86_TARGETS_H_
