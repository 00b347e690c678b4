/* See pool.h. The threads are OpenMP's: the same libgomp, and so the same worker threads, that
 * torch's own CPU ops run on in this process (torch loads libgomp.so.1 first; this extension's
 * need for the same soname is met by that copy). No thread of pdkv's own is ever created. */
#include "pool.h"

#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>

static atomic_int wanted = 1;  /* pdkv_pool_set_threads */
static atomic_int busy;        /* a split call is in progress */
static atomic_ulong split_calls;
/* Set in a child of fork(): libgomp's threads are not copied, and a team started in the child
 * would wait for the parent's; there every call runs on the caller (the same outputs). */
static atomic_int forked;

static void after_fork_child(void) { atomic_store(&forked, 1); }

__attribute__((constructor)) static void register_fork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

unsigned long pdkv_pool_split_calls(void) { return atomic_load_explicit(&split_calls, memory_order_relaxed); }

void pdkv_pool_set_threads(int n)
{
    atomic_store_explicit(&wanted, n < 1 ? 1 : n > PDKV_POOL_MAX_THREADS ? PDKV_POOL_MAX_THREADS : n,
                          memory_order_relaxed);
}

int pdkv_pool_threads(void) { return atomic_load_explicit(&wanted, memory_order_relaxed); }

static int run_inline(pdkv_part_fn fn, void *ctx, int parts)
{
    for (int p = 0; p < parts; p++)
        fn(ctx, p, parts);
    return 1;
}

int pdkv_pool_run(pdkv_part_fn fn, void *ctx, int parts)
{
    int threads = pdkv_pool_threads();
    if (parts > threads)
        parts = threads;
    if (parts <= 1)
        return run_inline(fn, ctx, parts < 1 ? 1 : parts);
    /* a call from inside a parallel region, or while another thread's call has the team: every
     * part on the caller, in order (the same outputs; no second team of threads) */
    int idle = 0;
    if (atomic_load(&forked) || omp_in_parallel() || !atomic_compare_exchange_strong(&busy, &idle, 1))
        return run_inline(fn, ctx, parts);
    int used = 1;
#pragma omp parallel num_threads(parts)
    {
        /* a team smaller than asked for (OMP_THREAD_LIMIT, no threads to be had) takes every part */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (t == 0)
            used = nt;
        for (int p = t; p < parts; p += nt)
            fn(ctx, p, parts);
    }
    atomic_store(&busy, 0);
    if (used > 1)
        atomic_fetch_add_explicit(&split_calls, 1, memory_order_relaxed);
    return used;
}
