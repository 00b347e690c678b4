/* The gated MLP of a decode step in one call (float32, CPU): y = down (silu(x Wg^T) * (x Wu^T)),
 * for a few rows, over pdkv_gemm_small; and a one-token MoE step, its k routed experts summed
 * with their routing weights. The additions are the ones torch's grouped path makes (models/moe.py):
 * each expert's output times its weight, added in the order given, the first onto zero. */
#ifndef PDKV_MLP_H
#define PDKV_MLP_H

#include <stddef.h>
#include <stdint.h>

/* x [m, h] (row stride ldx); gate_up [2 * inter, h] (gate rows, then up rows; row stride ldgu);
 * down [h, inter] (row stride ldd); y [m, h] (row stride ldy). Returns 0, -1 without memory. */
int pdkv_gated_mlp(const float *x, ptrdiff_t ldx, const float *gate_up, ptrdiff_t ldgu, const float *down,
                   ptrdiff_t ldd, float *y, ptrdiff_t ldy, int m, int h, int inter);

/* out[h] = the sum over the k routed (expert id, weight) pairs, in ascending expert order, of
 * weight * expert(x), the first onto zero (zeros when no pair is this rank's). This rank holds
 * global experts first .. first + local - 1, expert e at gate_up + (e - first) * gu_stride and
 * down + (e - first) * down_stride (rows as above); pairs of other ranks' experts are skipped
 * (expert parallelism). An id outside 0..num_experts-1, or k above 64, returns -1. */
int pdkv_moe_one_token(const float *x, const float *gate_up, ptrdiff_t gu_stride, ptrdiff_t ldgu,
                       const float *down, ptrdiff_t down_stride, ptrdiff_t ldd, const int64_t *ids,
                       const float *weights, int k, int64_t num_experts, int64_t first, int64_t local,
                       int h, int inter, float *out);

#endif
