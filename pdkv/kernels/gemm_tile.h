/* The register-blocked small-M GEMM, written once for a vector type and included by
 * gemm_avx2.c and gemm_avx512.c with these macros defined:
 *   TARGET       the function attribute of the ISA      VEC / W   the vector type, its lanes
 *   ZERO() LOAD(p) LOAD_TAIL(p, t) FMA(a, b, c) ADD(a, b) REDUCE(v) and GEMM_NAME, MAX_R (weight
 *   rows per tile), MAX_C (x rows per tile, at most 3): 2 * MAX_R * MAX_C accumulators + MAX_R +
 *   1 fit the registers.
 *   Optional (float32 by default): ELEM (the type of x, w, bias and y), VIN (a loaded vector;
 *   W elements of x or w), TO_F32(b) (a bias element as a float), STORE(p, s) (y from a float).
 *
 * y[m, o] is two vector accumulators over k (alternate blocks of W; lane j sums w[o, i] * x[m, i]
 * for i = j mod W, in order of i; the partial last vector is loaded with zeros past k), then
 * their sum, one fixed reduction and the bias. Those are the same float operations for every
 * (row, output) pair whatever the tile, M or the other rows are, so a row's result does not
 * depend on what it is batched with.
 *
 * A tile of MAX_R weight rows passes over every block of x rows before the next tile: each
 * weight is read from memory once per call, the later blocks find it in L1/L2, and each vector
 * load of w serves MAX_C rows of x (each load of x, MAX_R weight rows). */

#ifndef ELEM
#define ELEM float
#define VIN VEC
#define TO_F32(b) (b)
#define STORE(p, s) (*(p) = (s))
#endif

/* acc[.][.][h] += w . x over the W lanes at i, for every (weight row, x row) of the tile */
#define STEP(h, LD, ...)                                                                         \
    do {                                                                                         \
        VIN wv[MAX_R];                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = LD(w + r * ldw + i, ##__VA_ARGS__); \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                    \
            VIN xv = LD(x + c * ldx + i, ##__VA_ARGS__);                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                  \
                acc[r][c][h] = FMA(wv[r], xv, acc[r][c][h]);                                     \
        }                                                                                        \
    } while (0)

/* Two accumulators per (row, output), over alternate blocks of W: two chains of FMAs in flight
 * even for one row of x and one weight row (one chain is latency-bound below the memory's
 * speed). Then the odd block left, the tail, one add and one reduction: fixed by k alone. */
TARGET __attribute__((always_inline)) static inline void
tile(const ELEM *w, ptrdiff_t ldw, const ELEM *x, ptrdiff_t ldx, const ELEM *bias, ELEM *y,
     ptrdiff_t ldy, int R, int C, int k, int tail, const ELEM *pf)
{
    VEC acc[MAX_R][MAX_C][2];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = ZERO();
    int i = 0;
    for (; i + 2 * W <= k; i += 2 * W) {
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {  /* both blocks' lines */
            _mm_prefetch((const char *)(pf + r * ldw + i), _MM_HINT_T0);
            _mm_prefetch((const char *)(pf + r * ldw + i + W), _MM_HINT_T0);
        }
        STEP(0, LOAD);
        i += W;
        STEP(1, LOAD);
        i -= W;
    }
    if (i + W <= k) {
        STEP(0, LOAD);
        i += W;
    }
    if (tail)
        STEP(1, LOAD_TAIL, tail);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {
            float s = REDUCE(ADD(acc[r][c][0], acc[r][c][1]));
            STORE(y + c * ldy + r, bias ? s + TO_F32(bias[r]) : s);
        }
}

/* One tile shape per case so that every accumulator is a register (R and C constants). */
#define TILE_CASE(RR, CC) \
    case CC: tile(w, ldw, x, ldx, bias, y, ldy, RR, CC, k, tail, pf); break;

TARGET static void tile_full(const ELEM *w, ptrdiff_t ldw, const ELEM *x, ptrdiff_t ldx,
                             const ELEM *bias, ELEM *y, ptrdiff_t ldy, int C, int k, int tail,
                             const ELEM *pf)
{
    switch (C) {
        TILE_CASE(MAX_R, 1) TILE_CASE(MAX_R, 2) TILE_CASE(MAX_R, 3)
    }
}

/* the weight rows left past the last full tile (every row when m == 1), one at a time */
TARGET static void tile_one(const ELEM *w, ptrdiff_t ldw, const ELEM *x, ptrdiff_t ldx,
                            const ELEM *bias, ELEM *y, ptrdiff_t ldy, int C, int k, int tail,
                             const ELEM *pf)
{
    switch (C) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3)
    }
}

TARGET void GEMM_NAME(const ELEM *x, ptrdiff_t ldx, const ELEM *w, ptrdiff_t ldw, const ELEM *bias,
                      ELEM *y, ptrdiff_t ldy, int m, int k, int n)
{
    /* x blocks of near-equal size (7 rows: 2 + 2 + 3, not 3 + 3 + 1): the loads serve more rows */
    int blocks = (m + MAX_C - 1) / MAX_C;
    int tail = k % W;
    for (int o = 0; o < n;) {
        /* one row of x: one weight row at a time, a single stream front to back (with its two
         * chains of FMAs), measured faster than MAX_R streams side by side */
        int full = m > 1 && o + MAX_R <= n;
        const ELEM *wo = w + (ptrdiff_t)o * ldw;
        const ELEM *bo = bias ? bias + o : NULL;
        /* the next tile's rows, fetched while this one computes: one stream per weight row
         * is more than the hardware prefetcher follows at full speed (the first kernel's note) */
        int next = o + (full ? MAX_R : 1);
        const ELEM *pf = w + (ptrdiff_t)(next + MAX_R <= n ? next : o) * ldw;
        for (int b = 0, r0 = 0; b < blocks; b++) {
            int r1 = (int)((long)m * (b + 1) / blocks);
            const ELEM *xr = x + (ptrdiff_t)r0 * ldx;
            ELEM *yr = y + (ptrdiff_t)r0 * ldy + o;
            if (full)
                tile_full(wo, ldw, xr, ldx, bo, yr, ldy, r1 - r0, k, tail, pf);
            else
                tile_one(wo, ldw, xr, ldx, bo, yr, ldy, r1 - r0, k, tail, pf);
            r0 = r1;
        }
        o = next;
    }
}
