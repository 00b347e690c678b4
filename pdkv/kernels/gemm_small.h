/* Small-M float32 GEMMs for CPU decode steps: y[m, o] = sum_i x[m, i] * w[o, i] (+ bias[o]).
 *
 * A decode step multiplies a handful of rows by each weight, so it is bound by reading the
 * weight once from memory. On the x86 VMs this project runs on, MKL's sgemv/sgemm for M <= 16
 * read a cold weight at 9-14 GB/s; one contiguous pass over each weight row (4 FMA
 * accumulators, the rows of x kept in L1) reads it at 20-25 GB/s, about a 1-thread `sum`
 * (python -m pdkv.bench kernels measures both in the same run).
 *
 * The first kernel streamed each weight row once per PAIR of x rows, so an 8-row step read every
 * weight 4 times and its x loads bound it at ~3x a 1-row step. The blocked kernels
 * (gemm_tile.h) keep a tile of weight rows x a block of x rows in registers and pass every block
 * of x over the tile before the next: each weight is read from memory once per call, for any M.
 * Paths, picked at run time by what the CPU has: "avx512" (AVX-512F), "avx2" (AVX2+FMA), and
 * "pairs" (the first kernel, AVX2+FMA), which PDKV_GEMM_PATH=pairs or pdkv_gemm_set_path picks
 * for comparison.
 *
 * On one path every y[m, o] is the same sequence of float operations whatever M, the tiling or
 * the other rows are: a row's result does not depend on what it is batched with. Different paths
 * round differently (8- or 16-lane sums). */
#ifndef PDKV_GEMM_SMALL_H
#define PDKV_GEMM_SMALL_H

#include <stddef.h>

/* 1 when this CPU runs the AVX2+FMA kernels; 0: callers must use another GEMM. */
int pdkv_gemm_small_supported(void);

/* The path pdkv_gemm_small takes: "avx512", "avx2", "pairs", or "none" (not supported). */
const char *pdkv_gemm_path(void);

/* Makes pdkv_gemm_small take the path named (for tests and the bench); -1 when the name is
 * unknown or this CPU cannot run it (nothing changed). Not safe while another thread calls
 * pdkv_gemm_small. */
int pdkv_gemm_set_path(const char *name);

/* x [m, k] (row stride ldx), w [n, k] (row stride ldw), bias [n] or NULL, y [m, n] (row stride
 * ldy); every row's k values contiguous. Only valid when pdkv_gemm_small_supported(). */
void pdkv_gemm_small(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias,
                     float *y, ptrdiff_t ldy, int m, int k, int n);

#endif
