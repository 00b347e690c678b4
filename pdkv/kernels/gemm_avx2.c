/* The register-blocked small-M GEMM (gemm_tile.h) for AVX2+FMA: 2 weight rows x up to 3 rows of
 * x, 12 ymm accumulators (two per pair) + 2 + 1 (+ the tail's mask) of the 16 registers. Called only when the
 * CPU has AVX2 and FMA (gemm_small.c picks it at run time). */
#include "gemm_small_paths.h"

#include "avx2.h"

#ifdef PDKV_X86

/* lanes t.. of a partial last vector are not read (maskload reads nothing past k) */
static const int tail_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

#define TARGET AVX2
#define VEC __m256
#define W 8
#define ZERO() _mm256_setzero_ps()
#define LOAD(p) _mm256_loadu_ps(p)
#define LOAD_TAIL(p, t) _mm256_maskload_ps((p), _mm256_loadu_si256((const __m256i *)(tail_mask + 8 - (t))))
#define FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define ADD(a, b) _mm256_add_ps((a), (b))
#define REDUCE(v) hsum(v)
#define MAX_R 2
#define MAX_C 3

#define GEMM_NAME pdkv_gemm_avx2

#include "gemm_tile.h"

#endif
