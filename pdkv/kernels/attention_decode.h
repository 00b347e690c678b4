/* Decode attention on the CPU straight over the paged KV cache (float32): every query row is
 * one sequence's newest token, attending over that sequence's cached keys through its page
 * table, with no gather of K/V into a contiguous copy (what the torch backend does per layer).
 *
 * Layout by strides, in floats: key slot s of page p, KV head h is at
 * cache + p * page_stride + h * head_stride + s * slot_stride, its value v_offset floats
 * further on (0 for a latent cache, whose values are the first dv entries of its keys). So HND
 * [pages, 2, Hkv, P, D], NHD [pages, 2, P, Hkv, D] and the MLA latent [pages, 1, 1, P, L + R]
 * are all one kernel. Grouped-query attention: the g query heads of KV head h are q heads
 * h * g .. h * g + g - 1, and every key is read once for all of them. */
#ifndef PDKV_ATTENTION_DECODE_H
#define PDKV_ATTENTION_DECODE_H

#include <stddef.h>
#include <stdint.h>

struct pdkv_paged_kv {
    const float *cache;
    ptrdiff_t page_stride, head_stride, slot_stride, v_offset;
    int64_t num_pages;  /* page ids must be below it: anything else is refused, nothing read */
    int page_size;
};

/* The step's new key (and value) of each row, written into the cache before it attends:
 * row r's key head h at k + r * k_row + h * k_head (d floats), its value likewise (v NULL for a
 * latent cache: the key is the whole latent), into slot offsets[r] of page pages[r]. */
struct pdkv_kv_write {
    const float *k, *v;
    ptrdiff_t k_row, k_head, v_row, v_head;
    const int64_t *pages, *offsets;
};

/* q [b, hkv * g, d] (row stride q_row), out [b, hkv * g, dv] (row stride out_row); pages
 * [b, pages_row] (each sequence's page ids), kv_lens [b]; window > 0: each row sees only its
 * last `window` keys. scale multiplies q.k. `write` (or NULL): the new tokens' K/V to store
 * first. Returns 0, or -1 when a page id, a slot or a length is out of range (nothing is then
 * written; out is unspecified). Needs pdkv_gemm_small_supported(). */
int pdkv_decode_attention(const float *q, ptrdiff_t q_row, const struct pdkv_paged_kv *kv,
                          const struct pdkv_kv_write *write, const int64_t *pages, ptrdiff_t pages_row,
                          const int64_t *kv_lens, int window, float *out, ptrdiff_t out_row, int b, int hkv,
                          int g, int d, int dv, float scale);

#endif
