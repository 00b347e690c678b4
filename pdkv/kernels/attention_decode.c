/* See attention_decode.h. Two passes per (sequence, KV head): the scores of the g query heads
 * over every key (each key loaded once), a float32 softmax (its exp 8 lanes at a time), then
 * the weighted sum of values (each value loaded once). */
#include "attention_decode.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "avx2.h"

#ifdef PDKV_X86

#define MAX_GROUP 128   /* query heads per KV head the kernel takes (callers check) */
#define MAX_VALUE 1024  /* value width */

#define AHEAD 16  /* slots between a key's prefetch and its use */
#define HEAD_BLOCK 8     /* most query heads whose scores / value sums run side by side in registers */

/* v[r] = q_r . key for the NB rows qr[r]; NB = 4 or 8 (unrolled: the sums stay in registers) */
#define DEFINE_DOTS(NB)                                                                          \
    AVX2 static inline void dots##NB(const float *const *qr, const float *key, int d, float *v) \
    {                                                                                            \
        __m256 a[NB];                                                                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < NB; r++) a[r] = _mm256_setzero_ps();         \
        int i = 0;                                                                               \
        for (; i + 8 <= d; i += 8) {                                                             \
            __m256 k = _mm256_loadu_ps(key + i);                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < NB; r++)                                 \
                a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[r] + i), k, a[r]);                     \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < NB; r++) {                                   \
            float t = hsum(a[r]);                                                                \
            for (int j = i; j < d; j++)                                                          \
                t += qr[r][j] * key[j];                                                          \
            v[r] = t;                                                                            \
        }                                                                                        \
    }
DEFINE_DOTS(4)
DEFINE_DOTS(8)

/* acc[r * 8 + i] = sum_j p[j * g + rr[r]] * value_j[c + i] for r < NB; value_j at head + at[j] */
#define DEFINE_WEIGHTED(NB)                                                                       \
    AVX2 static inline void weighted##NB(const float *head, const ptrdiff_t *at, int64_t len,     \
                                         const float *p, int g, const int *rr, int c, float *acc) \
    {                                                                                             \
        __m256 a[NB];                                                                             \
        _Pragma("GCC unroll 8") for (int r = 0; r < NB; r++) a[r] = _mm256_setzero_ps();          \
        for (int64_t j = 0; j < len; j++) {                                                       \
            __m256 v = _mm256_loadu_ps(head + at[j] + c);                                         \
            const float *pj = p + j * g;                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < NB; r++)                                  \
                a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(pj + rr[r]), v, a[r]);                 \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < NB; r++) _mm256_storeu_ps(acc + r * 8, a[r]); \
    }
DEFINE_WEIGHTED(4)
DEFINE_WEIGHTED(8)

/* scores [len, g] -> exp(score - mx[head]) in place, and sum[head] of them. When g divides 8,
 * every 8 consecutive scores hold the same heads in the same lanes: one vector exp per 8 (the
 * scalar expf per score was ~1/6 of the kernel's time at 32 rows x 136 keys, 4 heads a group);
 * other groups take expf one score at a time. */
AVX2 static void softmax_exp(float *scores, int64_t len, int g, const float *mx, float *sum)
{
    for (int r = 0; r < g; r++)
        sum[r] = 0.0f;
    int64_t i = 0, total = len * g;
    if (8 % g == 0) {
        float lanes[8];
        for (int l = 0; l < 8; l++)
            lanes[l] = mx[l % g];
        const __m256 m = _mm256_loadu_ps(lanes);
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= total; i += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), m));
            _mm256_storeu_ps(scores + i, e);
            acc = _mm256_add_ps(acc, e);
        }
        _mm256_storeu_ps(lanes, acc);
        for (int l = 0; l < 8; l++)
            sum[l % g] += lanes[l];
    }
    for (; i < total; i++) {  /* the tail, or every score when g does not divide 8 */
        int r = (int)(i % g);
        float e = expf(scores[i] - mx[r]);
        scores[i] = e;
        sum[r] += e;
    }
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
    /* scores [longest, g], then each key's offset in a head's cache: the page table and its
     * divisions once per sequence, not once per key, head block and value column block */
    float *scores = malloc((sizeof(float) * (size_t)g + sizeof(ptrdiff_t)) * (size_t)longest);
    if (scores == NULL)
        return -1;
    ptrdiff_t *at = (ptrdiff_t *)(scores + (size_t)longest * (size_t)g);
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
    const int P = kv->page_size;
    for (int s = 0; s < b; s++) {
        const int64_t n = kv_lens[s];
        const int64_t first = window > 0 && n > window ? n - window : 0;
        const int64_t len = n - first;
        const int64_t *pg = pages + s * pages_row;
        for (int64_t j = 0, pos = first; j < len; j++, pos++)
            at[j] = pg[pos / P] * kv->page_stride + (pos % P) * kv->slot_stride;
        for (int h = 0; h < hkv; h++) {
            const float *qh = q + s * q_row + (ptrdiff_t)h * g * d;
            const float *head = kv->cache + h * kv->head_stride;
            float mx[MAX_GROUP], sum[MAX_GROUP];
            /* The g query heads in blocks of HEAD_BLOCK: each key (and value) chunk is loaded once
             * for the block's heads, whose HEAD_BLOCK sums are independent chains in registers
             * (one head at a time is a chain of dependent FMAs, latency-bound at long contexts). A
             * block's unused lanes repeat its first head (computed, never stored). */
            for (int r0 = 0; r0 < g; r0 += HEAD_BLOCK) {
                const int gb = g - r0 < HEAD_BLOCK ? g - r0 : HEAD_BLOCK;
                const float *qr[HEAD_BLOCK];
                for (int r = 0; r < HEAD_BLOCK; r++)
                    qr[r] = qh + (ptrdiff_t)(r0 + (r < gb ? r : 0)) * d;
                float bmax[HEAD_BLOCK];
                for (int r = 0; r < HEAD_BLOCK; r++)
                    bmax[r] = -INFINITY;
                for (int64_t j = 0; j < len; j++) {
                    const float *key = head + at[j];
                    /* the key and value AHEAD slots on (the first AHEAD at j = 0): pages are
                     * scattered, so the hardware prefetcher loses the stream at every page */
                    for (int64_t t = j == 0 ? 1 : AHEAD; r0 == 0 && t <= AHEAD && j + t < len; t++) {
                        const float *nk = head + at[j + t];
                        for (int i = 0; i < d; i += 16)
                            _mm_prefetch((const char *)(nk + i), _MM_HINT_T0);
                        for (int i = 0; i < dv; i += 16)
                            _mm_prefetch((const char *)(nk + kv->v_offset + i), _MM_HINT_T0);
                    }
                    float v[HEAD_BLOCK];
                    if (gb <= 4)
                        dots4(qr, key, d, v);
                    else
                        dots8(qr, key, d, v);
                    for (int r = 0; r < gb; r++) {
                        v[r] *= scale;
                        scores[j * g + r0 + r] = v[r];
                        if (v[r] > bmax[r])
                            bmax[r] = v[r];
                    }
                }
                for (int r = 0; r < gb; r++)
                    mx[r0 + r] = bmax[r];
            }
            softmax_exp(scores, len, g, mx, sum);
            /* out_r = sum_j p_rj v_j / sum_r: per 8 value columns and block of heads, the
             * HEAD_BLOCK running sums in registers over every key */
            for (int r0 = 0; r0 < g; r0 += HEAD_BLOCK) {
                const int gb = g - r0 < HEAD_BLOCK ? g - r0 : HEAD_BLOCK;
                int c = 0;
                for (; c + 8 <= dv; c += 8) {
                    float acc[HEAD_BLOCK * 8];
                    int rr[HEAD_BLOCK];
                    for (int r = 0; r < HEAD_BLOCK; r++)
                        rr[r] = r < gb ? r : 0;
                    if (gb <= 4)
                        weighted4(head + kv->v_offset, at, len, scores + r0, g, rr, c, acc);
                    else
                        weighted8(head + kv->v_offset, at, len, scores + r0, g, rr, c, acc);
                    for (int r = 0; r < gb; r++) {
                        float inv = 1.0f / sum[r0 + r];
                        float *o = out + s * out_row + (ptrdiff_t)(h * g + r0 + r) * dv + c;
                        for (int i = 0; i < 8; i++)
                            o[i] = acc[r * 8 + i] * inv;
                    }
                }
                for (; c < dv; c++)  /* value columns past the last 8 */
                    for (int r = 0; r < gb; r++) {
                        float a = 0.0f;
                        for (int64_t j = 0; j < len; j++)
                            a += scores[j * g + r0 + r] * head[at[j] + kv->v_offset + c];
                        out[s * out_row + (ptrdiff_t)(h * g + r0 + r) * dv + c] = a / sum[r0 + r];
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
