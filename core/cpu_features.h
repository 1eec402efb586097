// core/cpu_features.h: which x86 vector extensions this CPU has, detected
// once, for the kernels that pick an instruction set at run time
// (models/internal/gemv.cc, quant/internal/kernels_cpu.cc). Header-only, so
// the torch-free kernel libraries need no link to accel_core.
#ifndef ACCEL_CORE_CPU_FEATURES_H_
#define ACCEL_CORE_CPU_FEATURES_H_

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace accel {

struct CpuFeatures {
  bool avx2_fma_f16c = false;   // AVX2 with FMA and F16C (float16 conversions)
  bool avx512_f_bw = false;     // AVX-512 F and BW
  bool avx512_vl_vbmi = false;  // AVX-512 VL and VBMI (byte permutes)
  bool avx512_vnni = false;     // AVX-512 VNNI (vpdpbusd: int8 dot products)
  bool avx512_bf16 = false;     // AVX-512 BF16 (vdpbf16ps: bfloat16 dot products)
  // AVX-512 BW, VL and DQ: what libtorch 1.13 asks of a cpu before its
  // bfloat16 products go to oneDNN (mkldnn_bf16_device_check). Without them
  // at::matmul and at::linear in bfloat16 run a reference loop on one thread
  // (a 256-token Mixtral prompt took over 7 minutes on an AVX2 machine).
  bool onednn_bf16_matmul = false;
};

inline CpuFeatures DetectCpuFeatures() {
  CpuFeatures f;
#if defined(__x86_64__)
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  // __builtin_cpu_supports has no "f16c" in every compiler we build with.
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  f.avx2_fma_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  f.avx512_f_bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  f.avx512_vl_vbmi = __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
  f.avx512_vnni = __builtin_cpu_supports("avx512vnni");
  f.onednn_bf16_matmul = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512dq");
  // Nor "avx512bf16" in clang 14: CPUID leaf 7, subleaf 1, EAX bit 5.
  f.avx512_bf16 = f.avx512_f_bw && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 &&
                  (eax & (1u << 5)) != 0;
#endif
  return f;
}

// DetectCpuFeatures(), computed on first use.
inline const CpuFeatures& CpuFeaturesOfThisMachine() {
  static const CpuFeatures features = DetectCpuFeatures();
  return features;
}

}  // namespace accel

#endif  // ACCEL_CORE_CPU_FEATURES_H_
