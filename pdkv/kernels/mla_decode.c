/* See mla_decode.h. Composed of the other kernels (norm, rope, gemm_small, attention_decode). */
#include "mla_decode.h"

#include <stdlib.h>

#include "gemm_small.h"
#include "norm.h"
#include "rope.h"

int pdkv_mla_decode(const float *q, ptrdiff_t q_row, const float *kv, ptrdiff_t kv_row, const float *cos,
                    const float *sin, const struct pdkv_mla_weights *wt, const struct pdkv_paged_kv *cache,
                    const int64_t *slot_pages, const int64_t *slot_offsets, const int64_t *pages,
                    ptrdiff_t pages_row, const int64_t *kv_lens, float *out, int t)
{
    const int H = wt->heads, N = wt->nope, R = wt->rope, L = wt->lora, V = wt->value, D = L + R;
    float *lat = malloc(sizeof(float) * (size_t)t * (size_t)(D + H * D + H * L));
    if (lat == NULL)
        return -1;
    float *query = lat + (size_t)t * D, *olat = query + (size_t)t * H * D;
    for (int r = 0; r < t; r++) {
        const float *kr = kv + r * kv_row, *c = cos + (ptrdiff_t)r * R, *s = sin + (ptrdiff_t)r * R;
        pdkv_rms_norm(kr, 0, 0, wt->kv_norm, lat + (ptrdiff_t)r * D, 1, 1, L, wt->eps);
        pdkv_rope_vec(kr + L, c, s, R, lat + (ptrdiff_t)r * D + L);
        for (int h = 0; h < H; h++)
            pdkv_rope_vec(q + r * q_row + (ptrdiff_t)h * (N + R) + N, c, s, R, query + ((ptrdiff_t)r * H + h) * D + L);
    }
    for (int h = 0; h < H; h++)  /* W_UK folded into the query: [t, N] x [L, N]^T into query[:, h, :L] */
        pdkv_gemm_small(q + (ptrdiff_t)h * (N + R), q_row, wt->w_uk + h * wt->uk_head, wt->uk_row, NULL,
                        query + (ptrdiff_t)h * D, (ptrdiff_t)H * D, t, N, L);
    struct pdkv_kv_write write = {lat, NULL, D, 0, 0, 0, slot_pages, slot_offsets};
    int rc = pdkv_decode_attention(query, (ptrdiff_t)H * D, cache, &write, pages, pages_row, kv_lens, 0, olat,
                                   (ptrdiff_t)H * L, t, 1, H, D, L, wt->scale);
    if (rc == 0)
        for (int h = 0; h < H; h++)  /* W_UV after attention: [t, L] x [V, L]^T into out[:, h * V] */
            pdkv_gemm_small(olat + (ptrdiff_t)h * L, (ptrdiff_t)H * L, wt->w_uv + h * wt->uv_head, wt->uv_row, NULL,
                            out + (ptrdiff_t)h * V, (ptrdiff_t)H * V, t, L, V);
    free(lat);
    return rc;
}
