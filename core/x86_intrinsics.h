// <immintrin.h> for the x86 kernels (a no-op elsewhere), without GCC 12's
// false -Wuninitialized: its AVX-512 intrinsics initialise their "undefined"
// vectors from themselves, which the warning reports once inlined (GCC bug
// 105593).
#ifndef ACCEL_CORE_X86_INTRINSICS_H_
#define ACCEL_CORE_X86_INTRINSICS_H_

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif  // __x86_64__

#endif  // ACCEL_CORE_X86_INTRINSICS_H_
