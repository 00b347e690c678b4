/* Rotary embeddings (rotate-half convention) of a decode step's q and k heads, optionally after
 * a per-head RMSNorm (Qwen3's q_norm / k_norm), in one call per layer (CPU, float32):
 *   y = norm(x) (or x);  out[i] = y[i] * cos[i] + y[(i + d/2) % d] * sin[i]
 * with the tables of models/rope.py (sin stored as [-sin, sin]), what apply_rope computes with
 * torch.addcmul(x * cos, x.roll(d / 2), sin). */
#ifndef PDKV_ROPE_H
#define PDKV_ROPE_H

#include <stddef.h>

/* heads of row t: x + t * x_row + h * d (h < heads, d contiguous floats); cos/sin [t, d]
 * contiguous; norm_w [d] or NULL (then eps unused); out [t, heads, d] contiguous. */
void pdkv_norm_rope(const float *x, ptrdiff_t x_row, int t, int heads, int d, const float *norm_w, float eps,
                    const float *cos, const float *sin, float *out);

/* o = rope(x) of one d-float vector with one row of the tables (cos c, sin s, each d floats) */
void pdkv_rope_vec(const float *x, const float *c, const float *s, int d, float *o);

#endif
