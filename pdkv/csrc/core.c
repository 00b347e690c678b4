/* Messenger core, top: create/destroy and stats (see core.h). It calls down into the poller
 * thread (poller.c), which calls batch.c (posting, watches) and completions.c (arrivals); those
 * share records.c (per-batch completion records) and events.c (the event queue). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "core_internal.h"

pdkv_core *pdkv_core_create(pdkv_transport *t, const pdkv_core_opts *o, char *err, size_t errlen) {
    pdkv_core *c = calloc(1, sizeof(*c));
    if (!c) {
        t->ops->destroy(t);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->t = t;
    c->opts = *o;
    if (o->num_cpus > 64) c->opts.num_cpus = 64;
    for (int i = 0; i < c->opts.num_cpus; i++) c->cpus[i] = o->cpus[i];
    c->opts.cpus = c->cpus;
    pthread_mutex_init(&c->mu, NULL);
    c->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    c->out_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->wake_fd < 0 || c->out_fd < 0) {
        snprintf(err, errlen, "eventfd: %s", strerror(errno));
        goto fail;
    }
    /* pinned from its first instruction (not from inside the thread: no window on other CPUs) */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    if (c->opts.num_cpus > 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int i = 0; i < c->opts.num_cpus; i++)
            if (c->cpus[i] >= 0 && c->cpus[i] < CPU_SETSIZE) CPU_SET(c->cpus[i], &set);
        pthread_attr_setaffinity_np(&attr, sizeof(set), &set);
    }
    int rc = pthread_create(&c->thread, &attr, pdkv_poller_main, c);
    pthread_attr_destroy(&attr);
    if (rc == EINVAL && c->opts.num_cpus > 0) {
        snprintf(err, errlen, "cannot pin the poller to the given cpus (none of them is usable)");
        goto fail;
    }
    if (rc) {
        snprintf(err, errlen, "cannot start the poller thread: %s", strerror(rc));
        goto fail;
    }
    c->thread_started = 1;
    return c;
fail:
    pdkv_core_destroy(c);
    return NULL;
}

void pdkv_core_destroy(pdkv_core *c) {
    if (!c) return;
    if (c->thread_started) {
        __atomic_store_n(&c->stop, 1, __ATOMIC_RELEASE);
        pdkv_core_wake(c);
        pthread_join(c->thread, NULL);
    }
    /* the transport stops its own threads; writes in flight end there, nobody reads them now */
    c->t->ops->destroy(c->t);
    for (uint32_t i = 0; i < PDKV_MAX_WATCHES; i++)
        for (queued_batch *q = c->watches[i].head, *n; q; q = n) {
            n = q->next;
            free(q);
        }
    for (uint32_t i = 0; i < PDKV_IMM_BUCKETS; i++)
        for (imm_node *q = c->imms[i], *n; q; q = n) {
            n = q->next;
            free(q);
        }
    free(c->recs);
    free(c->ev);
    if (c->wake_fd >= 0) close(c->wake_fd);
    if (c->out_fd >= 0) close(c->out_fd);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

pdkv_transport *pdkv_core_transport(pdkv_core *c) { return c->t; }
int pdkv_core_event_fd(pdkv_core *c) { return c->out_fd; }

void pdkv_core_get_stats(pdkv_core *c, pdkv_core_stats *s) {
    __atomic_load(&c->st.polls, &s->polls, __ATOMIC_RELAXED);
    s->posted_batches = __atomic_load_n(&c->st.posted_batches, __ATOMIC_RELAXED);
    s->last_post_poll = __atomic_load_n(&c->st.last_post_poll, __ATOMIC_ACQUIRE);
    s->writes_posted = __atomic_load_n(&c->st.writes_posted, __ATOMIC_RELAXED);
    s->writes_done = __atomic_load_n(&c->st.writes_done, __ATOMIC_RELAXED);
    s->imms = __atomic_load_n(&c->st.imms, __ATOMIC_RELAXED);
    s->sleeps = __atomic_load_n(&c->st.sleeps, __ATOMIC_RELAXED);
    s->blocks = __atomic_load_n(&c->st.blocks, __ATOMIC_RELAXED);
    s->queued = __atomic_load_n(&c->num_queued, __ATOMIC_RELAXED);
}
