/* See attention_decode.h. Two passes per (sequence, KV head): the scores of the g query heads
 * over every key (each key loaded once), a float32 softmax, then the weighted sum of values
 * (each value loaded once). */
#include "attention_decode.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define MAX_GROUP 128   /* query heads per KV head the kernel takes (callers check) */
#define MAX_VALUE 1024  /* value width */

AVX2 static inline float hsum(__m256 v)
{
    __m128 l = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    l = _mm_add_ps(l, _mm_movehl_ps(l, l));
    l = _mm_add_ss(l, _mm_movehdup_ps(l));
    return _mm_cvtss_f32(l);
}

AVX2 static inline float dot(const float *a, const float *b, int n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

AVX2 static inline void axpy(float *y, float a, const float *x, int n)
{
    __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * x[i];
}

AVX2 int pdkv_decode_attention(const float *q, ptrdiff_t q_row, const struct pdkv_paged_kv *kv,
                               const struct pdkv_kv_write *write, const int64_t *pages, ptrdiff_t pages_row,
                               const int64_t *kv_lens, int window, float *out, ptrdiff_t out_row, int b, int hkv,
                               int g, int d, int dv, float scale)
{
    if (g < 1 || g > MAX_GROUP || dv < 1 || dv > MAX_VALUE || kv->page_size < 1)
        return -1;
    int64_t longest = 0;
    for (int s = 0; s < b; s++) {
        int64_t n = kv_lens[s];
        if (n < 1 || n > pages_row * (int64_t)kv->page_size)
            return -1;
        for (int64_t i = 0; i < (n + kv->page_size - 1) / kv->page_size; i++)
            if (pages[s * pages_row + i] < 0 || pages[s * pages_row + i] >= kv->num_pages)
                return -1;
        if (n > longest)
            longest = n;
        if (write && (write->pages[s] < 0 || write->pages[s] >= kv->num_pages || write->offsets[s] < 0
                      || write->offsets[s] >= kv->page_size))
            return -1;
    }
    if (write)
        for (int s = 0; s < b; s++) {
            float *slot = (float *)kv->cache + write->pages[s] * kv->page_stride + write->offsets[s] * kv->slot_stride;
            for (int h = 0; h < hkv; h++) {
                memcpy(slot + h * kv->head_stride, write->k + s * write->k_row + h * write->k_head,
                       sizeof(float) * (size_t)d);
                if (write->v)
                    memcpy(slot + h * kv->head_stride + kv->v_offset, write->v + s * write->v_row + h * write->v_head,
                           sizeof(float) * (size_t)d);
            }
        }
    float *scores = malloc(sizeof(float) * (size_t)longest * (size_t)g);
    if (scores == NULL)
        return -1;
    float acc[MAX_GROUP * 8];  /* chunk of the weighted value sums, see below */
    const int P = kv->page_size;
    for (int s = 0; s < b; s++) {
        const int64_t n = kv_lens[s];
        const int64_t first = window > 0 && n > window ? n - window : 0;
        const int64_t len = n - first;
        const int64_t *pg = pages + s * pages_row;
        for (int h = 0; h < hkv; h++) {
            const float *qh = q + s * q_row + (ptrdiff_t)h * g * d;
            const float *head = kv->cache + h * kv->head_stride;
            /* scores[j * g + r] = scale * q_r . k_j, then a softmax over j per r */
            float mx[MAX_GROUP];
            for (int r = 0; r < g; r++)
                mx[r] = -INFINITY;
            for (int64_t j = 0; j < len; j++) {
                int64_t pos = first + j;
                const float *key = head + pg[pos / P] * kv->page_stride + (pos % P) * kv->slot_stride;
                for (int r = 0; r < g; r++) {
                    float v = dot(qh + r * d, key, d) * scale;
                    scores[j * g + r] = v;
                    if (v > mx[r])
                        mx[r] = v;
                }
            }
            float sum[MAX_GROUP];
            for (int r = 0; r < g; r++)
                sum[r] = 0.0f;
            for (int64_t j = 0; j < len; j++)
                for (int r = 0; r < g; r++) {
                    float e = expf(scores[j * g + r] - mx[r]);
                    scores[j * g + r] = e;
                    sum[r] += e;
                }
            /* out_r = sum_j p_rj v_j, in chunks of 8 * MAX_GROUP / g value columns so the g
             * running sums stay in a small stack buffer */
            int chunk = (MAX_GROUP * 8) / g;
            for (int c0 = 0; c0 < dv; c0 += chunk) {
                int w = dv - c0 < chunk ? dv - c0 : chunk;
                memset(acc, 0, sizeof(float) * (size_t)w * (size_t)g);
                for (int64_t j = 0; j < len; j++) {
                    int64_t pos = first + j;
                    const float *val = head + pg[pos / P] * kv->page_stride + (pos % P) * kv->slot_stride
                        + kv->v_offset + c0;
                    for (int r = 0; r < g; r++)
                        axpy(acc + r * w, scores[j * g + r], val, w);
                }
                for (int r = 0; r < g; r++) {
                    float inv = 1.0f / sum[r];
                    float *o = out + s * out_row + (ptrdiff_t)(h * g + r) * dv + c0;
                    for (int i = 0; i < w; i++)
                        o[i] = acc[r * w + i] * inv;
                }
            }
        }
    }
    free(scores);
    return 0;
}

#else

int pdkv_decode_attention(const float *q, ptrdiff_t q_row, const struct pdkv_paged_kv *kv,
                          const struct pdkv_kv_write *write, const int64_t *pages, ptrdiff_t pages_row,
                          const int64_t *kv_lens, int window, float *out, ptrdiff_t out_row, int b, int hkv,
                          int g, int d, int dv, float scale)
{
    (void)q; (void)q_row; (void)kv; (void)write; (void)pages; (void)pages_row; (void)kv_lens; (void)window;
    (void)out; (void)out_row; (void)b; (void)hkv; (void)g; (void)d; (void)dv; (void)scale;
    return -1;
}

#endif
