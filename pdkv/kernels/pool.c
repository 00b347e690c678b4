/* See pool.h. */
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

/* Spins before a worker sleeps (and before the caller waits for the last part): a few tens of
 * microseconds, the gap between two GEMMs of a step; longer would take a core from whoever
 * else runs on a busy machine between steps. */
#define SPIN 4000

static atomic_int wanted = 1;  /* pdkv_pool_set_threads */

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;  /* one call at a time */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;       /* guards the sleeps below */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static int started;  /* workers running (ids 1..started); under run_lock */

/* The call in progress: written by the caller under run_lock, then each worker that has a part
 * is told by its own counter in `go` (release; the worker reads the call after it sees its counter
 * move, acquire). A worker without a part never looks at the call, so the caller may write the
 * next one as soon as the parts it handed out are done. */
static pdkv_part_fn job_fn;
static void *job_ctx;
static int job_parts;
static atomic_ulong go[PDKV_POOL_MAX_THREADS];
static atomic_int remaining;  /* parts 1..parts-1 not finished yet */
static unsigned long born[PDKV_POOL_MAX_THREADS];  /* go[id] when worker id was made */

static atomic_ulong split_calls;

unsigned long pdkv_pool_split_calls(void) { return atomic_load_explicit(&split_calls, memory_order_relaxed); }

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void *worker(void *arg)
{
    const int id = (int)(intptr_t)arg;
    atomic_ulong *mine = &go[id];
    unsigned long seen = born[id];  /* not a load of `mine`: its first call may already be posted */
    for (;;) {
        unsigned long g = seen;
        for (int i = 0; i < SPIN && (g = atomic_load_explicit(mine, memory_order_acquire)) == seen; i++)
            RELAX();
        if (g == seen) {
            pthread_mutex_lock(&lock);
            while ((g = atomic_load_explicit(mine, memory_order_acquire)) == seen)
                pthread_cond_wait(&wake, &lock);
            pthread_mutex_unlock(&lock);
        }
        seen = g;
        job_fn(job_ctx, id, job_parts);
        if (atomic_fetch_sub_explicit(&remaining, 1, memory_order_acq_rel) == 1) {
            /* under the lock: the caller checks `remaining` under it before it sleeps */
            pthread_mutex_lock(&lock);
            pthread_cond_signal(&done);
            pthread_mutex_unlock(&lock);
        }
    }
    return NULL;
}

/* fork(): no call is in progress (prepare takes run_lock), and the child has none of the
 * workers: it starts new ones when it needs them. */
static void before_fork(void) { pthread_mutex_lock(&run_lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&run_lock); }
static void after_fork_child(void)
{
    started = 0;
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
    pthread_cond_init(&done, NULL);
    atomic_store(&remaining, 0);
    pthread_mutex_unlock(&run_lock);
}

static void register_fork(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

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
    if (pthread_mutex_trylock(&run_lock) != 0)
        return run_inline(fn, ctx, parts);  /* another caller has the workers */
    pthread_once(&once, register_fork);
    while (started < parts - 1) {
        pthread_attr_t attr;
        pthread_t t;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        born[started + 1] = atomic_load(&go[started + 1]);
        int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)(started + 1));
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        started++;
    }
    if (parts > started + 1)
        parts = started + 1;  /* no more threads to be had: fewer, larger parts */
    if (parts <= 1) {
        pthread_mutex_unlock(&run_lock);
        return run_inline(fn, ctx, 1);
    }
    job_fn = fn;
    job_ctx = ctx;
    job_parts = parts;
    atomic_store_explicit(&remaining, parts - 1, memory_order_relaxed);
    pthread_mutex_lock(&lock);  /* a worker checks its counter under it before it sleeps */
    for (int p = 1; p < parts; p++)
        atomic_fetch_add_explicit(&go[p], 1, memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    fn(ctx, 0, parts);
    for (int i = 0; i < SPIN && atomic_load_explicit(&remaining, memory_order_acquire) > 0; i++)
        RELAX();
    if (atomic_load_explicit(&remaining, memory_order_acquire) > 0) {
        pthread_mutex_lock(&lock);
        while (atomic_load_explicit(&remaining, memory_order_acquire) > 0)
            pthread_cond_wait(&done, &lock);
        pthread_mutex_unlock(&lock);
    }
    pthread_mutex_unlock(&run_lock);
    atomic_fetch_add_explicit(&split_calls, 1, memory_order_relaxed);
    return parts;
}
