/* Messenger core: event queue, immediate counters, completion handling, lifecycle (see core.h).
 * Batches (posting, counters, queued batches) live in batch.c, the poller thread in poller.c. */
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
#include "cq.h"

void pdkv_core_seterr(char *err, const char *fmt, ...) {
    if (!err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, PDKV_REASON_MAX, fmt, ap);
    va_end(ap);
}

/* ---- events (caller holds mu) ---- */

void pdkv_core_emit(pdkv_core *c, const pdkv_event *e) {
    if (c->ev_count == c->ev_cap) {
        uint32_t ncap = c->ev_cap ? c->ev_cap * 2 : 256;
        pdkv_event *n = malloc((size_t)ncap * sizeof(*n));
        if (!n) return; /* out of memory: the event is lost, nothing else is corrupted */
        for (uint32_t i = 0; i < c->ev_count; i++) n[i] = c->ev[(c->ev_head + i) % c->ev_cap];
        free(c->ev);
        c->ev = n;
        c->ev_cap = ncap;
        c->ev_head = 0;
    }
    c->ev[(c->ev_head + c->ev_count) % c->ev_cap] = *e;
    if (c->ev_count++ == 0) {
        uint64_t one = 1;
        ssize_t r = write(c->out_fd, &one, sizeof(one));
        (void)r;
    }
}

int pdkv_core_drain(pdkv_core *c, pdkv_event *out, int max) {
    uint64_t v;
    ssize_t r = read(c->out_fd, &v, sizeof(v));
    (void)r;
    pthread_mutex_lock(&c->mu);
    int n = 0;
    while (n < max && c->ev_count) {
        out[n++] = c->ev[c->ev_head];
        c->ev_head = (c->ev_head + 1) % c->ev_cap;
        c->ev_count--;
    }
    if (c->ev_count) { /* more than max: keep the fd readable */
        uint64_t one = 1;
        r = write(c->out_fd, &one, sizeof(one));
    }
    pthread_mutex_unlock(&c->mu);
    return n;
}

/* ---- immediate counters (caller holds mu) ---- */

static imm_node **imm_slot(pdkv_core *c, uint32_t imm) {
    imm_node **p = &c->imms[(imm * 2654435761u) % PDKV_IMM_BUCKETS];
    while (*p && (*p)->imm != imm) p = &(*p)->next;
    return p;
}

static void imm_fire(pdkv_core *c, imm_node **p) {
    imm_node *n = *p;
    pdkv_event e = {.kind = PDKV_EV_IMM_DONE, .imm = n->imm, .peer = n->peer, .count = n->arrived,
                    .bytes = n->bytes};
    pdkv_core_emit(c, &e);
    *p = n->next;
    free(n);
}

int pdkv_core_expect(pdkv_core *c, uint32_t imm, uint64_t count, char *err) {
    int rc = 0;
    pthread_mutex_lock(&c->mu);
    imm_node **p = imm_slot(c, imm);
    if (!*p) {
        imm_node *n = calloc(1, sizeof(*n));
        if (!n) {
            pthread_mutex_unlock(&c->mu);
            pdkv_core_seterr(err, "out of memory");
            return -ENOMEM;
        }
        n->imm = imm;
        *p = n;
    }
    imm_node *n = *p;
    if (n->expected) {
        pdkv_core_seterr(err, "imm %u is already expected (%llu writes); forget() it first", imm,
               (unsigned long long)n->expected);
        rc = -EEXIST;
    } else if (count && n->arrived > count) {
        pdkv_core_seterr(err, "imm %u: %llu writes already landed, more than the %llu expected", imm,
               (unsigned long long)n->arrived, (unsigned long long)count);
        *p = n->next;
        free(n);
        rc = -EOVERFLOW;
    } else {
        n->expected = count;
        if (n->arrived >= count) imm_fire(c, p);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

int64_t pdkv_core_forget(pdkv_core *c, uint32_t imm, char *err) {
    pthread_mutex_lock(&c->mu);
    imm_node **p = imm_slot(c, imm);
    imm_node *n = *p;
    int64_t rc;
    if (!n) {
        pdkv_core_seterr(err, "imm %u has no counter", imm);
        rc = -ENOENT;
    } else {
        rc = (int64_t)n->arrived;
        *p = n->next;
        free(n);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void imm_arrived(pdkv_core *c, const pdkv_completion *cp) {
    imm_node **p = imm_slot(c, cp->imm);
    if (!*p) {
        imm_node *n = calloc(1, sizeof(*n));
        if (!n) return;
        n->imm = cp->imm;
        *p = n;
    }
    imm_node *n = *p;
    n->arrived++;
    n->bytes += cp->len;
    n->peer = cp->peer;
    if (n->expected && n->arrived >= n->expected) imm_fire(c, p);
}

static void handle_one(pdkv_core *c, const pdkv_completion *cp) {
    batch_rec *r;
    switch (cp->kind) {
    case PDKV_CQ_IMM:
        __atomic_add_fetch(&c->st.imms, 1, __ATOMIC_RELAXED);
        imm_arrived(c, cp);
        break;
    case PDKV_CQ_WRITE_DONE:
        __atomic_add_fetch(&c->st.writes_done, 1, __ATOMIC_RELAXED);
        if ((r = pdkv_rec_find(c, cp->wr_id))) {
            r->bytes += cp->len;
            r->peer = cp->peer;
            pdkv_rec_release(c, r);
        }
        break;
    default:
        if (cp->wr_id && (r = pdkv_rec_find(c, cp->wr_id))) {
            pdkv_rec_fail(r, cp->status ? cp->status : -EIO, cp->reason, 1);
            pdkv_rec_release(c, r);
        } else {
            pdkv_event e = {.kind = PDKV_EV_ERROR, .peer = cp->peer, .imm = cp->imm,
                            .status = cp->status ? cp->status : -EIO};
            memcpy(e.reason, cp->reason, sizeof(e.reason));
            pdkv_core_emit(c, &e);
        }
    }
}

void pdkv_core_handle(pdkv_core *c, const pdkv_completion *cps, int n) {
    pthread_mutex_lock(&c->mu); /* once per drained burst, not per completion */
    for (int i = 0; i < n; i++) handle_one(c, &cps[i]);
    pthread_mutex_unlock(&c->mu);
}

/* ---- lifecycle ---- */

void pdkv_core_wake(pdkv_core *c) {
    uint64_t one = 1;
    ssize_t r = write(c->wake_fd, &one, sizeof(one));
    (void)r;
}

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
