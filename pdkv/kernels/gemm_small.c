/* See gemm_small.h: the run-time choice of path, and the first kernel (pairs of rows), kept as
 * the fallback and as the baseline the bench measures the blocked kernels against. The kernels
 * are compiled for their ISA by function attribute (the rest of the build stays baseline x86-64). */
#include "gemm_small.h"

#include <stdlib.h>
#include <string.h>

#include "avx2.h"
#include "gemm_small_paths.h"
#include "pool.h"

#ifdef PDKV_X86


/* The output rows of one tile: at most 16 of them (16 * k floats, 32 KiB at k = 512) stay in
 * L1/L2 while every pair of x rows passes over them. */
#define ROW_TILE 16

/* dot(w, x) over k: 4 accumulators over blocks of 32, one over the blocks of 8 left, then the
 * scalar tail. ONE pass over w front to back: two rows streamed at once read at half the
 * bandwidth on the machines measured (the hardware prefetcher follows one stream best). */
AVX2 static inline float dot1(const float *w, const float *x, int k)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= k; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; i++)
        s += w[i] * x[i];
    return s;
}

/* dot1(w, x) and dot1(w, z) with each load of w used twice: the same operations per row. */
AVX2 static inline void dot2(const float *w, const float *x, const float *z, int k, float *sx, float *sz)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        __m256 w2 = _mm256_loadu_ps(w + i + 16), w3 = _mm256_loadu_ps(w + i + 24);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + i + 24), a3);
        b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(z + i), b0);
        b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(z + i + 8), b1);
        b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(z + i + 16), b2);
        b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(z + i + 24), b3);
    }
    for (; i + 8 <= k; i += 8) {
        __m256 w0 = _mm256_loadu_ps(w + i);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), a0);
        b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(z + i), b0);
    }
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    float t = hsum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
    for (; i < k; i++) {
        s += w[i] * x[i];
        t += w[i] * z[i];
    }
    *sx = s;
    *sz = t;
}

AVX2 void pdkv_gemm_pairs(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias,
                         float *y, ptrdiff_t ldy, int m, int k, int n)
{
    for (int o0 = 0; o0 < n; o0 += ROW_TILE) {
        int o1 = o0 + ROW_TILE < n ? o0 + ROW_TILE : n;
        int r = 0;
        for (; r + 2 <= m; r += 2) {
            const float *xr = x + (ptrdiff_t)r * ldx, *zr = xr + ldx;
            float *yr = y + (ptrdiff_t)r * ldy, *yz = yr + ldy;
            for (int o = o0; o < o1; o++) {
                float s, t;
                dot2(w + (ptrdiff_t)o * ldw, xr, zr, k, &s, &t);
                yr[o] = bias ? s + bias[o] : s;
                yz[o] = bias ? t + bias[o] : t;
            }
        }
        if (r < m) {
            const float *xr = x + (ptrdiff_t)r * ldx;
            float *yr = y + (ptrdiff_t)r * ldy;
            for (int o = o0; o < o1; o++) {
                float s = dot1(w + (ptrdiff_t)o * ldw, xr, k);
                yr[o] = bias ? s + bias[o] : s;
            }
        }
    }
}

int pdkv_gemm_small_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static const struct path {
    const char *name;
    pdkv_gemm_fn fn;
} paths[] = {{"avx512", pdkv_gemm_avx512}, {"avx2", pdkv_gemm_avx2}, {"pairs", pdkv_gemm_pairs}};

static int runs(int i)
{
    if (!pdkv_gemm_small_supported())
        return 0;
    return i > 0 || __builtin_cpu_supports("avx512f");
}

/* the best path this CPU runs, or the one PDKV_GEMM_PATH names (if this CPU runs it); written
 * once before the first call's use and only ever to the same value, so a race is harmless */
static int chosen = -1;

static int choose(void)
{
    if (chosen >= 0)
        return chosen;
    int best = 0;
    while (best < 2 && !runs(best))
        best++;
    const char *want = getenv("PDKV_GEMM_PATH");
    if (want != NULL && *want != '\0' && pdkv_gemm_set_path(want) == 0)
        return chosen;
    chosen = best;
    return chosen;
}

const char *pdkv_gemm_path(void)
{
    return pdkv_gemm_small_supported() ? paths[choose()].name : "none";
}

int pdkv_gemm_set_path(const char *name)
{
    for (int i = 0; i < 3; i++)
        if (strcmp(name, paths[i].name) == 0) {
            if (!runs(i))
                return -1;
            chosen = i;
            return 0;
        }
    return -1;
}

/* One call split by output columns (weight rows) for the pool (pool.h): part p takes a run of
 * whole 16-row blocks, so every tile of every part is a tile the one-thread call makes too. */
struct gemm_call {
    pdkv_gemm_fn fn;
    const float *x, *w, *bias;
    float *y;
    ptrdiff_t ldx, ldw, ldy;
    int m, k, n;
};

static void gemm_part(void *ctx, int part, int parts)
{
    const struct gemm_call *c = ctx;
    int o0, o1;
    pdkv_split_rows(c->n, part, parts, &o0, &o1);
    if (o0 < o1)
        c->fn(c->x, c->ldx, c->w + (ptrdiff_t)o0 * c->ldw, c->ldw, c->bias ? c->bias + o0 : NULL, c->y + o0, c->ldy,
              c->m, c->k, o1 - o0);
}

void pdkv_gemm_small(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias,
                     float *y, ptrdiff_t ldy, int m, int k, int n)
{
    pdkv_gemm_fn fn = paths[choose()].fn;
    int parts = pdkv_split_parts(m, k, n);
    if (parts <= 1) {
        fn(x, ldx, w, ldw, bias, y, ldy, m, k, n);
        return;
    }
    struct gemm_call c = {fn, x, w, bias, y, ldx, ldw, ldy, m, k, n};
    pdkv_pool_run(gemm_part, &c, parts);
}

#else  /* not x86-64: no kernel; callers keep torch's GEMM */

int pdkv_gemm_small_supported(void) { return 0; }

const char *pdkv_gemm_path(void) { return "none"; }

int pdkv_gemm_set_path(const char *name)
{
    (void)name;
    return -1;
}

void pdkv_gemm_small(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias,
                     float *y, ptrdiff_t ldy, int m, int k, int n)
{
    (void)x; (void)ldx; (void)w; (void)ldw; (void)bias; (void)y; (void)ldy; (void)m; (void)k; (void)n;
}

#endif
