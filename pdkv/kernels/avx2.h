/* What the AVX2 kernels share: PDKV_X86 (the kernels exist: x86-64 with GCC or clang), AVX2 (a
 * function compiled for AVX2+FMA while the rest of the build stays baseline x86-64; called only
 * after pdkv_gemm_small_supported()), the horizontal sum of a vector and a vector exp. */
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

/* exp of 8 floats: Cephes' expf (2^n times a degree-5 polynomial of the remainder), within
 * ~1 ulp of expf. Below -87.3 it gives 0, not a denormal; above 88.37 infinity. */
AVX2 static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
#endif

#endif
