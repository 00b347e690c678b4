/* Multi-head latent attention (DeepSeek-V2/V3) of a decode step, every row one new token, in one
 * call per layer (CPU, float32), the absorbed form models/mla.py runs with torch ops:
 *   latent = [rmsnorm(c_kv), rope(k_pe)]           stored into the row's cache slot
 *   query_h = [W_UK_h q_nope_h, rope(q_pe_h)]      per head
 *   o_h = W_UV_h (softmax(scale * query_h . latent_j) . c_kv_j)   over the row's cached latents
 * W_UK_h is stored [L, N] and W_UV_h [V, L] (input dimension contiguous, models/mla.py _stored). */
#ifndef PDKV_MLA_DECODE_H
#define PDKV_MLA_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "attention_decode.h"

struct pdkv_mla_weights {
    const float *kv_norm;  /* [L] */
    float eps;
    const float *w_uk;     /* head h, row l: w_uk + h * uk_head + l * uk_row (N floats) */
    ptrdiff_t uk_head, uk_row;
    const float *w_uv;     /* head h, row v: w_uv + h * uv_head + v * uv_row (L floats) */
    ptrdiff_t uv_head, uv_row;
    int heads, nope, rope, lora, value;  /* H, N, R, L, V */
    float scale;
};

/* q [t, H, N + R] (row stride q_row, heads N + R apart), kv [t, L + R] (row stride kv_row), cos/sin
 * [t, R]; the latent cache `cache` (one part, one head, L + R values per slot); slot_pages/offsets
 * [t]: where each row's latent goes; pages [t, pages_row], kv_lens [t]; out [t, H * V]. Returns 0,
 * or -1 for ids out of range or no memory (nothing stored then). */
int pdkv_mla_decode(const float *q, ptrdiff_t q_row, const float *kv, ptrdiff_t kv_row, const float *cos,
                    const float *sin, const struct pdkv_mla_weights *wt, const struct pdkv_paged_kv *cache,
                    const int64_t *slot_pages, const int64_t *slot_offsets, const int64_t *pages,
                    ptrdiff_t pages_row, const int64_t *kv_lens, float *out, int t);

#endif
