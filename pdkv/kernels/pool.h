/* The kernels' threads: one kernel call split across the cores.
 *
 * A decode step's GEMMs on one thread use one core's memory bandwidth and FMA pipes; on a
 * machine with free cores MKL reads the same weight on every thread, so without this the
 * kernels lose to it exactly where batching pays. A kernel splits its own work into parts that
 * write disjoint outputs, so every output is the same float operations whatever the thread
 * count; pdkv_pool_run runs the parts on an OpenMP team (pool.c), part 0 on the caller.
 *
 * One call at a time: a second caller (another engine's thread in the same process) runs every
 * part itself, in order, rather than wait or start a second team. */
#ifndef PDKV_POOL_H
#define PDKV_POOL_H

/* fn(ctx, part, parts) computes part `part` of `parts`. */
typedef void (*pdkv_part_fn)(void *ctx, int part, int parts);

#define PDKV_POOL_MAX_THREADS 64

/* The threads a call may use, the caller's included (clamped to 1..PDKV_POOL_MAX_THREADS).
 * They are OpenMP's, made on the first call that needs them with the affinity of the thread
 * that makes it (a role pinned by parallel.cpus keeps its kernels on its cores). */
void pdkv_pool_set_threads(int n);
int pdkv_pool_threads(void);

/* Runs fn(ctx, p, parts) for every p in 0..parts-1 (parts clamped to the thread count) and
 * returns when all have returned. Returns the number of threads that ran parts. */
int pdkv_pool_run(pdkv_part_fn fn, void *ctx, int parts);

/* Calls so far that ran on more than one thread (the bench and the tests read it). */
unsigned long pdkv_pool_split_calls(void);

/* How a GEMM-type kernel splits y[m, n] = x[m, k] w[n, k]^T for the pool: by runs of whole
 * 16-column blocks, into as many parts as there are threads and parts of at least
 * PDKV_MIN_PART_WORK multiply-adds (a smaller part costs less than waking a worker). */
#define PDKV_ROW_BLOCK 16
#define PDKV_MIN_PART_WORK 65536

static inline int pdkv_split_parts(int m, int k, int n)
{
    int threads = pdkv_pool_threads();
    if (threads <= 1)
        return 1;
    long long by_work = (long long)m * k * n / PDKV_MIN_PART_WORK;
    int blocks = (n + PDKV_ROW_BLOCK - 1) / PDKV_ROW_BLOCK;
    int parts = threads;
    if (parts > by_work)
        parts = (int)by_work;
    if (parts > blocks)
        parts = blocks;
    return parts < 1 ? 1 : parts;
}

/* Part `part` of `parts`: columns [*o0, *o1) (empty when there are more parts than blocks). */
static inline void pdkv_split_rows(int n, int part, int parts, int *o0, int *o1)
{
    int blocks = (n + PDKV_ROW_BLOCK - 1) / PDKV_ROW_BLOCK;
    int b0 = (int)((long long)blocks * part / parts), b1 = (int)((long long)blocks * (part + 1) / parts);
    *o0 = b0 * PDKV_ROW_BLOCK < n ? b0 * PDKV_ROW_BLOCK : n;
    *o1 = b1 * PDKV_ROW_BLOCK < n ? b1 * PDKV_ROW_BLOCK : n;
}

#endif
