/* The messenger's poller thread: no GIL, no Python, one loop.
 *
 * Each iteration drains transport completions into the core's tables and, while batches are
 * queued on counters, reads every watched counter and posts the batches whose value it reached.
 * Backoff when idle:
 *   - batches queued (a counter can move at any time, and nothing rings when it does): spin
 *     (cpu_relax) for spin_us, sched_yield() for yield_us, then sleep sleep_us per iteration;
 *   - nothing queued: block in poll() on the transport's eventfd and the wake eventfd at once.
 * So on a 2-core machine a waiting messenger costs a few % of a core, an idle one nothing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "core_internal.h"

#define DRAIN_MAX 64

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void drain_fd(int fd) {
    uint64_t v;
    ssize_t r = read(fd, &v, sizeof(v));
    (void)r;
}

/* Post every queued batch whose counter reached its value; returns how many. */
static int check_counters(pdkv_core *c) {
    queued_batch *ready = NULL, **tail = &ready;
    pthread_mutex_lock(&c->mu);
    for (uint32_t i = 0; i < PDKV_MAX_WATCHES; i++) {
        watch *w = &c->watches[i];
        if (!w->addr || !w->head) continue;
        /* acquire: the page contents written before the bump are visible to our writes */
        int64_t v = __atomic_load_n(w->addr, __ATOMIC_ACQUIRE);
        while (w->head && w->head->value <= v) {
            queued_batch *q = w->head;
            w->head = q->next;
            q->next = NULL;
            *tail = q;
            tail = &q->next;
        }
    }
    pthread_mutex_unlock(&c->mu);
    int n = 0;
    char err[PDKV_ERR_MAX];
    while (ready) {
        queued_batch *q = ready;
        ready = q->next;
        pdkv_core_post_internal(c, q->conn, &q->b, q->tag, 1, err);
        __atomic_sub_fetch(&c->num_queued, 1, __ATOMIC_RELEASE);
        __atomic_add_fetch(&c->st.posted_batches, 1, __ATOMIC_RELAXED);
        __atomic_store_n(&c->st.last_post_poll, __atomic_load_n(&c->st.polls, __ATOMIC_RELAXED),
                         __ATOMIC_RELEASE);
        free(q);
        n++;
    }
    return n;
}

static int drain_transport(pdkv_core *c) {
    pdkv_completion cp[DRAIN_MAX];
    int n = c->t->ops->poll(c->t, cp, DRAIN_MAX);
    if (n > 0) pdkv_core_handle(c, cp, n);
    return n > 0 ? n : 0;
}

void *pdkv_poller_main(void *arg) {
    pdkv_core *c = arg;
    int tfd = c->t->ops->event_fd(c->t);
    uint64_t idle_since = now_us();
    while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
        __atomic_add_fetch(&c->st.polls, 1, __ATOMIC_RELAXED);
        int work = drain_transport(c);
        int queued = __atomic_load_n(&c->num_queued, __ATOMIC_ACQUIRE) > 0;
        if (queued) work += check_counters(c);
        if (work) {
            idle_since = now_us();
            continue;
        }
        uint64_t idle = now_us() - idle_since;
        if (!queued) {
            /* only completions to wait for: they ring the transport's eventfd, so spinning
             * would just take a core from the threads that produce them */
            idle = UINT64_MAX;
        }
        if (idle < c->opts.spin_us) {
            cpu_relax();
        } else if (idle < (uint64_t)c->opts.spin_us + c->opts.yield_us) {
            sched_yield();
        } else if (queued) {
            __atomic_add_fetch(&c->st.sleeps, 1, __ATOMIC_RELAXED);
            struct timespec ts = {0, (long)c->opts.sleep_us * 1000};
            nanosleep(&ts, NULL);
        } else {
            /* reset both fds, then look once more: anything pushed after the reset rewrites them.
             * NOTE: stop too -- a destroy that set it and woke us just before the reset has had
             * its wake-up drained here, and nothing would ever end the poll below */
            drain_fd(c->wake_fd);
            if (tfd >= 0) drain_fd(tfd);
            if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) || drain_transport(c)
                || __atomic_load_n(&c->num_queued, __ATOMIC_ACQUIRE)) {
                idle_since = now_us();
                continue;
            }
            __atomic_add_fetch(&c->st.blocks, 1, __ATOMIC_RELAXED);
            struct pollfd pf[2] = {{c->wake_fd, POLLIN, 0}, {tfd, POLLIN, 0}};
            poll(pf, tfd >= 0 ? 2 : 1, -1);
            idle_since = now_us();
        }
    }
    return NULL;
}
