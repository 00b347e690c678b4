/* What the AVX2 kernels share: PDKV_X86 (the kernels exist: x86-64 with GCC or clang), AVX2 (a
 * function compiled for AVX2+FMA while the rest of the build stays baseline x86-64; called only
 * after pdkv_gemm_small_supported()), and the horizontal sum of a vector. */
#ifndef PDKV_AVX2_H
#define PDKV_AVX2_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PDKV_X86 1
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float hsum(__m256 v)
{
    __m128 l = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    l = _mm_add_ps(l, _mm_movehl_ps(l, l));
    l = _mm_add_ss(l, _mm_movehdup_ps(l));
    return _mm_cvtss_f32(l);
}
#endif

#endif
