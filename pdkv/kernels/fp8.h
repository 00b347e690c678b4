/* Block-quantized FP8 weights to float32 (CPU): out = e4m3(w) * scale of its bn x bk block, the
 * one float32 multiply torch's w.float() * s makes (the same bits). e4m3 decodes through a
 * 256-entry table the caller passes (torch's own decoding of every byte), so this file knows
 * nothing of the format; a table read per value instead of torch's scalar conversion. */
#ifndef PDKV_FP8_H
#define PDKV_FP8_H

#include <stddef.h>
#include <stdint.h>

/* w [n, k] bytes, row stride ldw; scale [ceil(n / bn), ceil(k / bk)] row stride lds; lut [256];
 * out [n, k] row stride ldo (floats). */
void pdkv_fp8_dequant(const uint8_t *w, ptrdiff_t ldw, const float *scale, ptrdiff_t lds, const float *lut,
                      float *out, ptrdiff_t ldo, int n, int k, int bn, int bk);

#endif
