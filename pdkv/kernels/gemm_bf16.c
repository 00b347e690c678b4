/* See gemm_bf16.h: gemm_tile.h over bfloat16 with vdpbf16ps (4 weight rows x up to 3 rows of x
 * in zmm accumulators, 32 bf16 per load). Compiled for AVX512-BF16 by function attribute (the
 * rest of the build stays baseline x86-64) and called only after pdkv_gemm_bf16_supported(). */
#include "gemm_bf16.h"

#include <string.h>

#include "avx2.h"
#include "pool.h"

#ifdef PDKV_X86

#define TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))

/* the bits of a bfloat16 as a float (exact) */
static inline float bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* a float rounded to the nearest bfloat16, ties to even; NaN stays a (quiet) NaN */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define ELEM uint16_t
#define VEC __m512
#define VIN __m512bh
#define W 32
#define ZERO() _mm512_setzero_ps()
#define LOAD(p) ((__m512bh)_mm512_loadu_si512((const void *)(p)))
#define LOAD_TAIL(p, t) ((__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << (t)) - 1), (p)))
#define FMA(a, b, c) _mm512_dpbf16_ps((c), (a), (b))
#define ADD(a, b) _mm512_add_ps((a), (b))
#define REDUCE(v) _mm512_reduce_add_ps(v)
#define TO_F32(b) bf16_to_f32(b)
#define STORE(p, s) (*(p) = f32_to_bf16(s))
#define MAX_R 4
#define MAX_C 3
#define GEMM_NAME pdkv_gemm_bf16_one_thread

#include "gemm_tile.h"

struct bf16_call {
    const uint16_t *x, *w, *bias;
    uint16_t *y;
    ptrdiff_t ldx, ldw, ldy;
    int m, k, n;
};

/* columns split as gemm_small.c splits them (pool.h) */
static void bf16_part(void *ctx, int part, int parts)
{
    const struct bf16_call *c = ctx;
    int o0, o1;
    pdkv_split_rows(c->n, part, parts, &o0, &o1);
    if (o0 < o1)
        pdkv_gemm_bf16_one_thread(c->x, c->ldx, c->w + (ptrdiff_t)o0 * c->ldw, c->ldw, c->bias ? c->bias + o0 : NULL, c->y + o0,
                        c->ldy, c->m, c->k, o1 - o0);
}

void pdkv_gemm_bf16(const uint16_t *x, ptrdiff_t ldx, const uint16_t *w, ptrdiff_t ldw, const uint16_t *bias,
                    uint16_t *y, ptrdiff_t ldy, int m, int k, int n)
{
    int parts = pdkv_split_parts(m, k, n);
    if (parts <= 1) {
        pdkv_gemm_bf16_one_thread(x, ldx, w, ldw, bias, y, ldy, m, k, n);
        return;
    }
    struct bf16_call c = {x, w, bias, y, ldx, ldw, ldy, m, k, n};
    pdkv_pool_run(bf16_part, &c, parts);
}

int pdkv_gemm_bf16_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
}

#else  /* not x86-64 */

int pdkv_gemm_bf16_supported(void) { return 0; }

void pdkv_gemm_bf16(const uint16_t *x, ptrdiff_t ldx, const uint16_t *w, ptrdiff_t ldw,
                    const uint16_t *bias, uint16_t *y, ptrdiff_t ldy, int m, int k, int n)
{
    (void)x; (void)ldx; (void)w; (void)ldw; (void)bias; (void)y; (void)ldy; (void)m; (void)k; (void)n;
}

#endif
