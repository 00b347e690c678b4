/* See mlp.h. Compiled with -ffp-contract=off (setup.py): every product and sum below is rounded
 * on its own, as torch's separate ops round them, so the MoE sums match the grouped path's. */
#include "mlp.h"

#include <math.h>
#include <stdlib.h>

#include "gemm_small.h"

#include "avx2.h"

/* act = silu(gate) * up, 8 lanes at a time where the CPU runs this file's callers (AVX2: a
 * gated MLP runs only where pdkv_gemm_small does); the scalar expf per element was 4-6% of a
 * gated MLP call at 8-32 rows. moe_one_token goes through here too, so its sums stay the bits of
 * the per-expert gated_mlp. */
#ifdef PDKV_X86
AVX2 static void silu_mul(const float *gu, int inter, float *act)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    int i = 0;
    for (; i + 8 <= inter; i += 8) {
        __m256 g = _mm256_loadu_ps(gu + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(s, _mm256_loadu_ps(gu + inter + i)));
    }
    for (; i < inter; i++) {
        float g = gu[i];
        act[i] = (g / (1.0f + expf(-g))) * gu[inter + i];
    }
}
#else
static void silu_mul(const float *gu, int inter, float *act)
{
    for (int i = 0; i < inter; i++) {
        float g = gu[i];
        act[i] = (g / (1.0f + expf(-g))) * gu[inter + i];
    }
}
#endif

int pdkv_gated_mlp(const float *x, ptrdiff_t ldx, const float *gate_up, ptrdiff_t ldgu, const float *down,
                   ptrdiff_t ldd, float *y, ptrdiff_t ldy, int m, int h, int inter)
{
    float *gu = malloc(sizeof(float) * (size_t)m * 3 * (size_t)inter);
    if (gu == NULL)
        return -1;
    float *act = gu + (size_t)m * 2 * inter;
    pdkv_gemm_small(x, ldx, gate_up, ldgu, NULL, gu, 2 * inter, m, h, 2 * inter);
    for (int r = 0; r < m; r++)
        silu_mul(gu + (size_t)r * 2 * inter, inter, act + (size_t)r * inter);
    pdkv_gemm_small(act, inter, down, ldd, NULL, y, ldy, m, inter, h);
    free(gu);
    return 0;
}

#define MAX_TOP_K 64

int pdkv_moe_one_token(const float *x, const float *gate_up, ptrdiff_t gu_stride, ptrdiff_t ldgu,
                       const float *down, ptrdiff_t down_stride, ptrdiff_t ldd, const int64_t *ids,
                       const float *weights, int k, int64_t num_experts, int64_t first, int64_t local,
                       int h, int inter, float *out)
{
    if (k < 0 || k > MAX_TOP_K)
        return -1;
    int64_t e[MAX_TOP_K];
    float w[MAX_TOP_K];
    int n = 0;
    for (int i = 0; i < k; i++) {
        if (ids[i] < 0 || ids[i] >= num_experts)
            return -1;
        if (ids[i] < first || ids[i] >= first + local)
            continue;  /* another rank's expert: it adds its own */
        int j = n++;  /* insertion sort, ascending by id */
        while (j > 0 && e[j - 1] > ids[i]) {
            e[j] = e[j - 1];
            w[j] = w[j - 1];
            j--;
        }
        e[j] = ids[i];
        w[j] = weights[i];
    }
    if (n == 0) {
        for (int j = 0; j < h; j++)
            out[j] = 0.0f;
        return 0;
    }
    float *y = malloc(sizeof(float) * (size_t)h);
    if (y == NULL)
        return -1;
    for (int i = 0; i < n; i++) {
        int64_t local_id = e[i] - first;
        if (pdkv_gated_mlp(x, h, gate_up + local_id * gu_stride, ldgu, down + local_id * down_stride, ldd,
                           y, h, 1, h, inter)) {
            free(y);
            return -1;
        }
        for (int j = 0; j < h; j++) {
            float t = y[j] * w[i];
            out[j] = i == 0 ? t : out[j] + t;
        }
    }
    free(y);
    return 0;
}
