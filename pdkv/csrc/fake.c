/* FAKE transport with fault injection (see fake.h). In-process only; for tests. */
#define _GNU_SOURCE
#include "fake.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cq.h"
#include "regions.h"

#define MAX_FAULTS 16
#define FAKE_INFO_MAGIC 0x414b4450u /* "PDKA" */

typedef struct fault { int kind; uint64_t first, count; uint32_t delay_us; } fault;

typedef struct fake_conn {
    uint64_t peer, remote_id;
    uint32_t remote_conn; /* unused: the remote side is found by id */
    int state;            /* 1 prepared, 2 connected, 3 dead */
} fake_conn;

typedef struct delayed {
    uint64_t due_us, src_id;
    uint32_t conn;
    pdkv_write w;
    const uint8_t *src;
    struct delayed *next;
} delayed;

typedef struct fake_t {
    pdkv_transport base;
    uint64_t id;
    pdkv_regions regions;
    pdkv_cq cq;
    fake_conn conns[256];
    uint32_t num_conns;
    fault faults[MAX_FAULTS];
    int num_faults;
    uint64_t posted;
    delayed *pending;
    uint64_t refused_writes; /* under g_mu */
    struct fake_t *next;
} fake_t;

/* One lock for every fake endpoint: deliveries touch two endpoints at once. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static fake_t *g_all;
static uint64_t g_next_id = 1;
static __thread char tls_err[PDKV_ERR_MAX];

static int ferr(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof(tls_err), fmt, ap);
    va_end(ap);
    return code;
}

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static fake_t *by_id(uint64_t id) {
    for (fake_t *f = g_all; f; f = f->next)
        if (f->id == id) return f;
    return NULL;
}

/* The remote endpoint's connection back to node `peer` (caller holds g_mu). */
static fake_conn *back_conn(fake_t *r, uint64_t peer) {
    for (uint32_t i = 0; i < r->num_conns; i++)
        if (r->conns[i].peer == peer && r->conns[i].state != 3) return &r->conns[i];
    return NULL;
}

static void kill_conn(fake_t *f, fake_conn *c, int status, const char *local, const char *remote) {
    if (c->state == 3) return;
    c->state = 3;
    pdkv_cq_pushf(&f->cq, PDKV_CQ_ERROR, 0, c->peer, 0, status, 0, "%s", local);
    fake_t *r = by_id(c->remote_id);
    fake_conn *rc = r ? back_conn(r, f->base.node_id) : NULL;
    if (rc) {
        rc->state = 3;
        pdkv_cq_pushf(&r->cq, PDKV_CQ_ERROR, 0, f->base.node_id, 0, status, 0, "%s", remote);
    }
}

/* Land one write at the remote (caller holds g_mu). Returns 0, or <0 if the remote refused. */
static int land(fake_t *f, fake_conn *c, const pdkv_write *w, const uint8_t *src) {
    fake_t *r = by_id(c->remote_id);
    if (!r) return -ENOTCONN;
    uint8_t *dst;
    uint64_t ticket;
    char why[PDKV_REASON_MAX];
    int rc = pdkv_regions_pin_remote(&r->regions, w->rkey, f->base.node_id, w->roff, w->len, &dst, &ticket, why,
                                     sizeof(why));
    if (rc < 0) {
        r->refused_writes++;
        char local[PDKV_REASON_MAX];
        snprintf(local, sizeof(local), "peer %llu refused a write: %s", (unsigned long long)c->peer, why);
        kill_conn(f, c, rc, local, why);
        return rc;
    }
    memcpy(dst, src, w->len);
    pdkv_regions_unpin_remote(&r->regions, w->rkey, f->base.node_id, ticket);
    if (w->has_imm) pdkv_cq_pushf(&r->cq, PDKV_CQ_IMM, 0, f->base.node_id, w->len, 0, w->imm, NULL);
    return 0;
}

static const fault *fault_for(fake_t *f, uint64_t n) {
    for (int i = 0; i < f->num_faults; i++)
        if (n >= f->faults[i].first && (f->faults[i].count == 0 || n < f->faults[i].first + f->faults[i].count))
            return &f->faults[i];
    return NULL;
}

static void done(fake_t *f, fake_conn *c, const pdkv_write *w, int status, const char *reason) {
    pdkv_regions_unpin(&f->regions, w->lkey);
    if (status == 0)
        pdkv_cq_pushf(&f->cq, PDKV_CQ_WRITE_DONE, w->wr_id, c->peer, w->len, 0, 0, NULL);
    else
        pdkv_cq_pushf(&f->cq, PDKV_CQ_ERROR, w->wr_id, c->peer, w->len, status, 0, "%s", reason);
}

static int f_post(pdkv_transport *bt, uint32_t id, const pdkv_write *w, int n) {
    fake_t *f = (fake_t *)bt;
    pthread_mutex_lock(&g_mu);
    fake_conn *c = id >= 1 && id <= f->num_conns ? &f->conns[id - 1] : NULL;
    if (!c || c->state != 2) {
        pthread_mutex_unlock(&g_mu);
        return ferr(-ENOTCONN, "fake connection %u is not connected", id);
    }
    const uint8_t *src[n > 0 ? n : 1];
    for (int i = 0; i < n; i++) {
        uint8_t *p;
        int rc = pdkv_regions_pin_local(&f->regions, w[i].lkey, w[i].loff, w[i].len, &p, tls_err, sizeof(tls_err));
        if (rc < 0) {
            for (int j = 0; j < i; j++) pdkv_regions_unpin(&f->regions, w[j].lkey);
            pthread_mutex_unlock(&g_mu);
            return rc;
        }
        src[i] = p;
    }
    for (int i = 0; i < n; i++) {
        const fault *ft = fault_for(f, f->posted++);
        int kind = ft ? ft->kind : 0;
        if (kind == PDKV_FAKE_VANISH && c->state != 3)
            kill_conn(f, c, -ECONNRESET, "FAKE: peer disappeared", "FAKE: peer disconnected");
        if (c->state == 3) {
            done(f, c, &w[i], -ECONNRESET, "connection is down");
            continue;
        }
        if (kind == PDKV_FAKE_CORRUPT) {
            kill_conn(f, c, -EPROTO, "peer refused a write: corrupted frame header (FAKE)",
                      "corrupted frame header (FAKE)");
            done(f, c, &w[i], -EPROTO, "corrupted frame header (FAKE)");
            continue;
        }
        if (kind == PDKV_FAKE_DELAY) {
            delayed *d = malloc(sizeof(*d));
            if (d) {
                *d = (delayed){.due_us = now_us() + ft->delay_us, .conn = id, .w = w[i], .src = src[i], .next = f->pending};
                f->pending = d;
                uint64_t one = 1;
                ssize_t r = write(f->cq.efd, &one, sizeof(one)); /* keep the poller looking */
                (void)r;
                continue;
            }
        }
        int rc = kind == PDKV_FAKE_DROP ? 0 : land(f, c, &w[i], src[i]);
        if (rc == 0 && kind == PDKV_FAKE_DUPLICATE) rc = land(f, c, &w[i], src[i]);
        if (rc == 0 && kind == PDKV_FAKE_ERROR)
            done(f, c, &w[i], -EIO, "injected error completion (FAKE)");
        else
            done(f, c, &w[i], rc, "peer refused the write");
    }
    pthread_mutex_unlock(&g_mu);
    return n;
}

static int f_poll(pdkv_transport *bt, pdkv_completion *out, int max) {
    fake_t *f = (fake_t *)bt;
    pthread_mutex_lock(&g_mu);
    uint64_t now = now_us();
    for (delayed **p = &f->pending; *p;) {
        delayed *d = *p;
        if (d->due_us > now) {
            p = &d->next;
            continue;
        }
        *p = d->next;
        fake_conn *c = &f->conns[d->conn - 1];
        int rc = c->state == 2 ? land(f, c, &d->w, d->src) : -ECONNRESET;
        done(f, c, &d->w, rc, "connection dropped before a delayed write landed");
        free(d);
    }
    if (f->pending) {
        uint64_t one = 1;
        ssize_t r = write(f->cq.efd, &one, sizeof(one));
        (void)r;
    }
    pthread_mutex_unlock(&g_mu);
    return pdkv_cq_poll(&f->cq, out, max);
}

static int f_reg(pdkv_transport *bt, void *a, uint64_t l, uint64_t *k) {
    return pdkv_regions_add(&((fake_t *)bt)->regions, a, l, k, tls_err, sizeof(tls_err));
}
static int f_grant(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t *out) {
    if (out) *out = k;
    return pdkv_regions_grant(&((fake_t *)bt)->regions, k, p, tls_err, sizeof(tls_err));
}
static int f_revoke(pdkv_transport *bt, uint64_t k, uint64_t p) {
    return pdkv_regions_revoke(&((fake_t *)bt)->regions, k, p, tls_err, sizeof(tls_err));
}
static int f_grant_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len, uint64_t *out) {
    if (out) *out = k;
    return pdkv_regions_grant_range(&((fake_t *)bt)->regions, k, p, off, len, tls_err, sizeof(tls_err));
}
static int f_revoke_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len) {
    return pdkv_regions_revoke_range(&((fake_t *)bt)->regions, k, p, off, len, tls_err, sizeof(tls_err));
}
static void f_counters(pdkv_transport *bt, pdkv_transport_counters *out) {
    pthread_mutex_lock(&g_mu);
    out->refused_writes = ((fake_t *)bt)->refused_writes;
    pthread_mutex_unlock(&g_mu);
}
static int f_dereg(pdkv_transport *bt, uint64_t k) {
    return pdkv_regions_remove(&((fake_t *)bt)->regions, k, tls_err, sizeof(tls_err));
}

static int f_prepare(pdkv_transport *bt, uint64_t peer, void *info, uint32_t *len, uint32_t *conn) {
    fake_t *f = (fake_t *)bt;
    pthread_mutex_lock(&g_mu);
    if (f->num_conns == 256) {
        pthread_mutex_unlock(&g_mu);
        return ferr(-ENOSPC, "fake transport: too many connections");
    }
    f->conns[f->num_conns] = (fake_conn){.peer = peer, .state = 1};
    *conn = ++f->num_conns;
    uint64_t blob[3] = {FAKE_INFO_MAGIC, f->id, f->base.node_id};
    memcpy(info, blob, sizeof(blob));
    *len = sizeof(blob);
    pthread_mutex_unlock(&g_mu);
    return 0;
}

static int f_complete(pdkv_transport *bt, uint32_t id, const void *info, uint32_t len) {
    fake_t *f = (fake_t *)bt;
    uint64_t blob[3];
    if (len != sizeof(blob)) return ferr(-EINVAL, "fake connection info must be %zu bytes", sizeof(blob));
    memcpy(blob, info, sizeof(blob));
    if (blob[0] != FAKE_INFO_MAGIC) return ferr(-EINVAL, "not fake connection info");
    pthread_mutex_lock(&g_mu);
    fake_conn *c = id >= 1 && id <= f->num_conns ? &f->conns[id - 1] : NULL;
    int rc = 0;
    if (!c || c->state != 1) rc = ferr(-EINVAL, "fake connection %u is not prepared", id);
    else if (!by_id(blob[1])) rc = ferr(-ECONNREFUSED, "fake peer endpoint %llu does not exist", (unsigned long long)blob[1]);
    else if (blob[2] != c->peer) rc = ferr(-EINVAL, "connection info is from node %llu, expected %llu",
                                          (unsigned long long)blob[2], (unsigned long long)c->peer);
    else {
        c->remote_id = blob[1];
        c->state = 2;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static int f_disconnect(pdkv_transport *bt, uint32_t id) {
    fake_t *f = (fake_t *)bt;
    pthread_mutex_lock(&g_mu);
    int rc = 0;
    if (id < 1 || id > f->num_conns) rc = ferr(-ENOENT, "unknown fake connection %u", id);
    else f->conns[id - 1].state = 3;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static int f_event_fd(pdkv_transport *bt) { return ((fake_t *)bt)->cq.efd; }
static const char *f_last_error(pdkv_transport *bt) {
    (void)bt;
    return tls_err;
}

static void f_destroy(pdkv_transport *bt) {
    fake_t *f = (fake_t *)bt;
    pthread_mutex_lock(&g_mu);
    for (fake_t **p = &g_all; *p; p = &(*p)->next)
        if (*p == f) {
            *p = f->next;
            break;
        }
    for (uint32_t i = 0; i < f->num_conns; i++)
        if (f->conns[i].state == 2) kill_conn(f, &f->conns[i], -ECONNRESET, "closed", "peer closed the connection");
    while (f->pending) {
        delayed *d = f->pending;
        f->pending = d->next;
        free(d);
    }
    pthread_mutex_unlock(&g_mu);
    pdkv_regions_destroy(&f->regions);
    pdkv_cq_destroy(&f->cq);
    free(f);
}

static const pdkv_transport_ops fake_ops = {
    .name = "fake", .reg = f_reg, .grant = f_grant, .revoke = f_revoke, .grant_range = f_grant_range,
    .revoke_range = f_revoke_range, .dereg = f_dereg, .prepare = f_prepare, .complete = f_complete,
    .disconnect = f_disconnect, .post = f_post, .poll = f_poll, .event_fd = f_event_fd,
    .last_error = f_last_error, .counters = f_counters, .destroy = f_destroy,
};

pdkv_transport *pdkv_fake_create(uint64_t node_id, char *err, size_t errlen) {
    fake_t *f = calloc(1, sizeof(*f));
    if (!f) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    int rc = pdkv_cq_init(&f->cq);
    if (rc < 0) {
        snprintf(err, errlen, "completion queue: %s", strerror(-rc));
        free(f);
        return NULL;
    }
    f->base.ops = &fake_ops;
    f->base.node_id = node_id;
    pdkv_regions_init(&f->regions);
    pthread_mutex_lock(&g_mu);
    f->id = g_next_id++;
    f->next = g_all;
    g_all = f;
    pthread_mutex_unlock(&g_mu);
    return &f->base;
}

int pdkv_fake_add_fault(pdkv_transport *bt, int kind, uint64_t first, uint64_t count, uint32_t delay_us) {
    if (bt->ops != &fake_ops) return ferr(-EINVAL, "not a fake transport");
    if (kind < PDKV_FAKE_DROP || kind > PDKV_FAKE_VANISH) return ferr(-EINVAL, "unknown fault kind %d", kind);
    fake_t *f = (fake_t *)bt;
    pthread_mutex_lock(&g_mu);
    int rc = 0;
    if (f->num_faults == MAX_FAULTS) rc = ferr(-ENOSPC, "too many faults");
    else f->faults[f->num_faults++] = (fault){kind, first, count, delay_us};
    pthread_mutex_unlock(&g_mu);
    return rc;
}
