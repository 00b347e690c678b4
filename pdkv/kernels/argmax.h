/* Greedy sampling's argmax over float32 logits rows (CPU): torch's argmax over a [32, 32000]
 * batch took ~0.9 ms on one thread (~4 GB/s), this one reads the rows at vector speed. */
#ifndef PDKV_ARGMAX_H
#define PDKV_ARGMAX_H

#include <stddef.h>
#include <stdint.h>

/* out[r] = the first index of row r's maximum, for x [rows, n] (row stride ld floats), n >= 1.
 * Returns 0, or -1 when a row holds a NaN (torch counts NaN as the maximum: the caller asks
 * torch instead; out is then unspecified). Needs pdkv_gemm_small_supported(). */
int pdkv_argmax_rows(const float *x, ptrdiff_t ld, int rows, int n, int64_t *out);

#endif
