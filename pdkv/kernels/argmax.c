/* See argmax.h. Two passes per row: the maximum (8 lanes, and whether any lane was NaN), then
 * the first index holding it; the row is in L1/L2 for the second pass, which stops there. */
#include "argmax.h"

#include "avx2.h"

#ifdef PDKV_X86

AVX2 int pdkv_argmax_rows(const float *x, ptrdiff_t ld, int rows, int n, int64_t *out)
{
    for (int r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        __m256 best = _mm256_set1_ps(row[0]), nan = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(row + i);
            best = _mm256_max_ps(best, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        if (_mm256_movemask_ps(nan))
            return -1;
        float lanes[8], m;
        _mm256_storeu_ps(lanes, best);
        m = lanes[0];
        for (int l = 1; l < 8; l++)
            m = lanes[l] > m ? lanes[l] : m;
        for (; i < n; i++) {
            if (row[i] != row[i])
                return -1;
            m = row[i] > m ? row[i] : m;
        }
        int64_t at = 0;
        const __m256 target = _mm256_set1_ps(m);
        for (i = 0; i + 8 <= n; i += 8) {
            int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
            if (hit) {
                at = i + __builtin_ctz((unsigned)hit);
                break;
            }
        }
        if (i + 8 > n)  /* not in the full vectors: in the tail */
            for (at = i; at < n && row[at] != m; at++)
                ;
        out[r] = at;
    }
    return 0;
}

#else

int pdkv_argmax_rows(const float *x, ptrdiff_t ld, int rows, int n, int64_t *out)
{
    (void)x; (void)ld; (void)rows; (void)n; (void)out;
    return -1;
}

#endif
