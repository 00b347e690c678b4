/* The register-blocked small-M GEMM (gemm_tile.h) for AVX-512F: 4 weight rows x up to 3 rows of
 * x, 24 zmm accumulators (two per pair) + 4 + 1 of the 32 registers. Called only when the CPU has AVX-512F
 * (gemm_small.c picks it at run time); the rest of the build stays baseline x86-64. */
#include "gemm_small_paths.h"

#include "avx2.h"

#ifdef PDKV_X86

#define TARGET __attribute__((target("avx512f,avx2,fma")))
#define VEC __m512
#define W 16
#define ZERO() _mm512_setzero_ps()
#define LOAD(p) _mm512_loadu_ps(p)
#define LOAD_TAIL(p, t) _mm512_maskz_loadu_ps((__mmask16)((1u << (t)) - 1), (p))
#define FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define ADD(a, b) _mm512_add_ps((a), (b))
#define REDUCE(v) _mm512_reduce_add_ps(v)
#define MAX_R 4
#define MAX_C 3

#define GEMM_NAME pdkv_gemm_avx512

#include "gemm_tile.h"

#endif
