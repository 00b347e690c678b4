/* See attention_decode.h. Two passes per (sequence, KV head): the scores of the g query heads
 * over every key (each key loaded once per head block), a float32 softmax (its exp 8 lanes at a
 * time), then the weighted sum of values (each value loaded once per head block). Scores are
 * kept head-major, [g, len], so a head's softmax and its broadcasts read one contiguous row. */
#include "attention_decode.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "avx2.h"
#include "pool.h"

#include <stdatomic.h>

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

/* The 8 scores q . key[k] of one head for 8 keys, one vector: 8 independent FMA chains, then a
 * transposing reduction (7 hadds, 2 lane swaps) in place of 8 horizontal sums. For the few query
 * heads of small GQA groups (g < 4) the per-key path above spends more on its horizontal sums
 * and padded lanes than on the products: at d = 32, 4 hsums against 4 FMAs a head. (At 4 heads
 * of 64 it was slower, 0.8x the per-key path's speed at 32 rows x 576 keys.) */
AVX2 static inline __m256 dots_keys8(const float *q, const float *const *key, int d)
{
    __m256 a[8];
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++)
            a[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[k] + i), a[k]);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    if (i < d) {  /* widths off the 8-float vectors */
        float t[8];
        _mm256_storeu_ps(t, s);
        for (int k = 0; k < 8; k++)
            for (int j = i; j < d; j++)
                t[k] += q[j] * key[k][j];
        s = _mm256_loadu_ps(t);
    }
    return s;
}

/* acc[(r * NC + n) * 8 + i] = sum_j pr[r][j] * value_j[c + n * 8 + i] for r < NB, n < NC; value_j
 * at head + at[j]. NB * NC = 8 running sums in registers: a group of 1 or 2 heads takes 64 or 32
 * value columns per pass over the keys, not 8 (each pass re-walks every key's value). */
#define DEFINE_WEIGHTED(NB, NC)                                                                     \
    AVX2 static inline void weighted##NB##x##NC(const float *head, const ptrdiff_t *at, int64_t len, \
                                                 const float *const *pr, int c, float *acc)           \
    {                                                                                               \
        __m256 a[NB * NC];                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < NB * NC; r++) a[r] = _mm256_setzero_ps();       \
        for (int64_t j = 0; j < len; j++) {                                                         \
            const float *vj = head + at[j] + c;                                                     \
            __m256 v[NC];                                                                           \
            _Pragma("GCC unroll 8") for (int n = 0; n < NC; n++) v[n] = _mm256_loadu_ps(vj + n * 8); \
            _Pragma("GCC unroll 8") for (int r = 0; r < NB; r++) {                                  \
                const __m256 p = _mm256_broadcast_ss(pr[r] + j);                                    \
                _Pragma("GCC unroll 8") for (int n = 0; n < NC; n++)                                \
                    a[r * NC + n] = _mm256_fmadd_ps(p, v[n], a[r * NC + n]);                        \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < NB * NC; r++) _mm256_storeu_ps(acc + r * 8, a[r]); \
    }
DEFINE_WEIGHTED(1, 8)
DEFINE_WEIGHTED(1, 1)
DEFINE_WEIGHTED(2, 4)
DEFINE_WEIGHTED(2, 1)
DEFINE_WEIGHTED(4, 2)
DEFINE_WEIGHTED(4, 1)
DEFINE_WEIGHTED(8, 1)

/* The weighted sums of rows pr[0 .. rows) (rows = 1, 2, 4 or 8: a block's spare rows repeat its
 * first) over value columns [c, c + 8 * nc), nc = 8 / rows or 1; acc as in weighted##NB##x##NC. */
AVX2 static inline void weighted(int rows, int nc, const float *head, const ptrdiff_t *at, int64_t len,
                                 const float *const *pr, int c, float *acc)
{
    if (rows == 1)
        (nc == 8 ? weighted1x8 : weighted1x1)(head, at, len, pr, c, acc);
    else if (rows == 2)
        (nc == 4 ? weighted2x4 : weighted2x1)(head, at, len, pr, c, acc);
    else if (rows == 4)
        (nc == 2 ? weighted4x2 : weighted4x1)(head, at, len, pr, c, acc);
    else
        weighted8x1(head, at, len, pr, c, acc);
}

/* scores [g, len] -> exp(score - mx[head]) in place, and sum[head] of them: 8 lanes at a time
 * along each head's row (the scalar expf per score was ~1/6 of the kernel's time at 32 rows x
 * 136 keys, 4 heads a group). */
AVX2 static void softmax_exp(float *scores, int64_t len, int g, const float *mx, float *sum)
{
    for (int r = 0; r < g; r++) {
        float *row = scores + (size_t)r * (size_t)len;
        const __m256 m = _mm256_set1_ps(mx[r]);
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), m));
            _mm256_storeu_ps(row + i, e);
            acc = _mm256_add_ps(acc, e);
        }
        float t = hsum(acc);
        for (; i < len; i++) {
            row[i] = expf(row[i] - mx[r]);
            t += row[i];
        }
        sum[r] = t;
    }
}

/* Prefetch the keys and values of slots [from, min(to, len)). */
AVX2 static inline void prefetch_slots(const float *head, const ptrdiff_t *at, int64_t from, int64_t to, int64_t len,
                                       int d, int dv, ptrdiff_t v_offset)
{
    for (int64_t t = from; t < to && t < len; t++) {
        const float *nk = head + at[t];
        for (int i = 0; i < d; i += 16)
            _mm_prefetch((const char *)(nk + i), _MM_HINT_T0);
        for (int i = 0; i < dv; i += 16)
            _mm_prefetch((const char *)(nk + v_offset + i), _MM_HINT_T0);
    }
}

/* The arguments of one call, shared by its parts. */
struct attn_call {
    const float *q;
    ptrdiff_t q_row;
    const struct pdkv_paged_kv *kv;
    const int64_t *pages;
    ptrdiff_t pages_row;
    const int64_t *kv_lens;
    int window;
    float *out;
    ptrdiff_t out_row;
    int hkv, g, d, dv;
    float scale;
    int64_t longest;
    int bounds[PDKV_POOL_MAX_THREADS + 1];  /* part p: items bounds[p] .. bounds[p + 1] - 1 */
    atomic_int failed;
};

/* One KV head h of sequence s over its `len` keys at cache offsets `at` (scores: len * g floats
 * of scratch): every output of the g query heads of h. */
AVX2 static void attend_head(const struct attn_call *a, int s, int h, int64_t len, const ptrdiff_t *at,
                             float *scores)
{
    const float *q = a->q;
    const ptrdiff_t q_row = a->q_row, out_row = a->out_row;
    const int g = a->g, d = a->d, dv = a->dv;
    const float scale = a->scale;
    float *out = a->out;
    const struct pdkv_paged_kv *kv = a->kv;
    const float *qh = q + s * q_row + (ptrdiff_t)h * g * d;
    const float *head = kv->cache + h * kv->head_stride;
    float mx[MAX_GROUP], sum[MAX_GROUP];
    /* The g query heads in blocks of HEAD_BLOCK: each key (and value) chunk is loaded once
     * for the block's heads, whose sums are independent chains in registers (one head at
     * a time is a chain of dependent FMAs, latency-bound at long contexts). A block of 4
     * or more heads takes a key at a time for all of them; one of fewer takes 8 keys at a
     * time for each head (dots_keys8), and keys past the last 8 a key at a time. Spare
     * lanes repeat the block's first head (computed, never stored). */
    for (int r0 = 0; r0 < g; r0 += HEAD_BLOCK) {
        const int gb = g - r0 < HEAD_BLOCK ? g - r0 : HEAD_BLOCK;
        const float *qr[HEAD_BLOCK];
        for (int r = 0; r < HEAD_BLOCK; r++)
            qr[r] = qh + (ptrdiff_t)(r0 + (r < gb ? r : 0)) * d;
        float bmax[HEAD_BLOCK];
        for (int r = 0; r < HEAD_BLOCK; r++)
            bmax[r] = -INFINITY;
        int64_t j = 0;
        if (gb < 4) {
            const __m256 sc = _mm256_set1_ps(scale);
            __m256 vmax[4];
            for (int r = 0; r < 4; r++)
                vmax[r] = _mm256_set1_ps(-INFINITY);
            for (; j + 8 <= len; j += 8) {
                if (r0 == 0)
                    prefetch_slots(head, at, j == 0 ? 1 : j + AHEAD, j + AHEAD + 8, len, d, dv, kv->v_offset);
                const float *keys[8];
                for (int k = 0; k < 8; k++)
                    keys[k] = head + at[j + k];
                for (int r = 0; r < gb; r++) {
                    const __m256 v = _mm256_mul_ps(dots_keys8(qr[r], keys, d), sc);
                    _mm256_storeu_ps(scores + (size_t)(r0 + r) * (size_t)len + j, v);
                    vmax[r] = _mm256_max_ps(vmax[r], v);
                }
            }
            for (int r = 0; r < gb; r++) {
                float t[8];
                _mm256_storeu_ps(t, vmax[r]);
                for (int k = 0; k < 8; k++)
                    if (t[k] > bmax[r])
                        bmax[r] = t[k];
            }
        }
        for (; j < len; j++) {
            const float *key = head + at[j];
            /* the key and value AHEAD slots on (the first AHEAD at j = 0): pages are
             * scattered, so the hardware prefetcher loses the stream at every page */
            if (r0 == 0)
                prefetch_slots(head, at, j == 0 ? 1 : j + AHEAD, j + AHEAD + 1, len, d, dv, kv->v_offset);
            float v[HEAD_BLOCK];
            if (gb <= 4)
                dots4(qr, key, d, v);
            else
                dots8(qr, key, d, v);
            for (int r = 0; r < gb; r++) {
                v[r] *= scale;
                scores[(size_t)(r0 + r) * (size_t)len + j] = v[r];
                if (v[r] > bmax[r])
                    bmax[r] = v[r];
            }
        }
        for (int r = 0; r < gb; r++)
            mx[r0 + r] = bmax[r];
    }
    softmax_exp(scores, len, g, mx, sum);
    /* out_r = sum_j p_rj v_j / sum_r: per block of heads, 8 running sums in registers over
     * every key, as 8 / rows value vectors of each of its rows */
    for (int r0 = 0; r0 < g; r0 += HEAD_BLOCK) {
        const int gb = g - r0 < HEAD_BLOCK ? g - r0 : HEAD_BLOCK;
        const int rows = gb == 1 ? 1 : gb == 2 ? 2 : gb <= 4 ? 4 : 8;
        const float *pr[HEAD_BLOCK];
        for (int r = 0; r < HEAD_BLOCK; r++)
            pr[r] = scores + (size_t)(r0 + (r < gb ? r : 0)) * (size_t)len;
        int c = 0;
        while (c + 8 <= dv) {
            const int nc = c + 64 / rows <= dv ? 8 / rows : 1;
            float acc[64];
            weighted(rows, nc, head + kv->v_offset, at, len, pr, c, acc);
            for (int r = 0; r < gb; r++) {
                const float inv = 1.0f / sum[r0 + r];
                float *o = out + s * out_row + (ptrdiff_t)(h * g + r0 + r) * dv + c;
                for (int i = 0; i < 8 * nc; i++)
                    o[i] = acc[r * nc * 8 + i] * inv;
            }
            c += 8 * nc;
        }
        for (; c < dv; c++)  /* value columns past the last 8 */
            for (int r = 0; r < gb; r++) {
                float a = 0.0f;
                for (int64_t j = 0; j < len; j++)
                    a += pr[r][j] * head[at[j] + kv->v_offset + c];
                out[s * out_row + (ptrdiff_t)(h * g + r0 + r) * dv + c] = a / sum[r0 + r];
            }
    }
}

/* Items are (sequence, KV head) pairs, s * hkv + h: a part takes a run of them (one sequence's
 * heads in order, then the next's), with its own scratch and key-offset table, so the parts
 * write disjoint outputs and each output is the same operations whatever the split. */
AVX2 static void attend_part(void *ctx, int part, int parts)
{
    (void)parts;
    struct attn_call *a = ctx;
    const int i0 = a->bounds[part], i1 = a->bounds[part + 1];
    if (i0 >= i1)
        return;
    /* scores [longest, g], then each key's offset in a head's cache: the page table and its
     * divisions once per sequence, not once per key, head block and value column block */
    float *scores = malloc((sizeof(float) * (size_t)a->g + sizeof(ptrdiff_t)) * (size_t)a->longest);
    if (scores == NULL) {
        atomic_store(&a->failed, 1);
        return;
    }
    ptrdiff_t *at = (ptrdiff_t *)(scores + (size_t)a->longest * (size_t)a->g);
    const int P = a->kv->page_size;
    int s_at = -1;
    int64_t len = 0;
    for (int i = i0; i < i1; i++) {
        const int s = i / a->hkv, h = i % a->hkv;
        if (s != s_at) {
            const int64_t n = a->kv_lens[s];
            const int64_t first = a->window > 0 && n > a->window ? n - a->window : 0;
            const int64_t *pg = a->pages + s * a->pages_row;
            len = n - first;
            for (int64_t j = 0, pos = first; j < len; j++, pos++)
                at[j] = pg[pos / P] * a->kv->page_stride + (pos % P) * a->kv->slot_stride;
            s_at = s;
        }
        attend_head(a, s, h, len, at, scores);
    }
    free(scores);
}

/* Below this many keys x query heads in a call, one thread: a part must outweigh waking a
 * worker (a few microseconds). */
#define MIN_PARALLEL_WORK 16384

AVX2 int pdkv_decode_attention(const float *q, ptrdiff_t q_row, const struct pdkv_paged_kv *kv,
                               const struct pdkv_kv_write *write, const int64_t *pages, ptrdiff_t pages_row,
                               const int64_t *kv_lens, int window, float *out, ptrdiff_t out_row, int b, int hkv,
                               int g, int d, int dv, float scale)
{
    if (g < 1 || g > MAX_GROUP || dv < 1 || dv > MAX_VALUE || kv->page_size < 1 || hkv < 1 || b < 1)
        return -1;
    int64_t longest = 0, work = 0;
    for (int s = 0; s < b; s++) {
        int64_t n = kv_lens[s];
        if (n < 1 || n > pages_row * (int64_t)kv->page_size)
            return -1;
        for (int64_t i = 0; i < (n + kv->page_size - 1) / kv->page_size; i++)
            if (pages[s * pages_row + i] < 0 || pages[s * pages_row + i] >= kv->num_pages)
                return -1;
        if (n > longest)
            longest = n;
        work += window > 0 && n > window ? window : n;
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
    struct attn_call a = {q, q_row, kv, pages, pages_row, kv_lens, window, out, out_row, hkv, g, d, dv, scale,
                          longest, {0}, 0};
    const int items = b * hkv;
    int parts = pdkv_pool_threads();
    if ((int64_t)parts > work * hkv * g / MIN_PARALLEL_WORK)
        parts = (int)(work * hkv * g / MIN_PARALLEL_WORK);
    if (parts > items)
        parts = items;
    if (parts < 1)
        parts = 1;
    /* runs of items of near-equal keys: part p ends at the first item past p + 1 parts' share */
    a.bounds[0] = 0;
    int64_t done = 0;
    int p = 1;
    for (int i = 0; i < items && p < parts; i++) {
        const int64_t n = kv_lens[i / hkv];
        done += window > 0 && n > window ? window : n;
        while (p < parts && done * parts >= (int64_t)p * work * hkv)
            a.bounds[p++] = i + 1;
    }
    while (p <= parts)
        a.bounds[p++] = items;
    pdkv_pool_run(attend_part, &a, parts);
    return atomic_load(&a.failed) ? -1 : 0;
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
