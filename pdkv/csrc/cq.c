/* Completion ring + eventfd (see cq.h). */
#include "cq.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

int pdkv_cq_init(pdkv_cq *q) {
    memset(q, 0, sizeof(*q));
    q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (q->efd < 0) return -errno;
    q->cap = 256;
    q->ring = calloc(q->cap, sizeof(*q->ring));
    if (!q->ring) {
        close(q->efd);
        return -ENOMEM;
    }
    pthread_mutex_init(&q->mu, NULL);
    return 0;
}

void pdkv_cq_destroy(pdkv_cq *q) {
    if (q->efd >= 0) close(q->efd);
    q->efd = -1;
    free(q->ring);
    q->ring = NULL;
    pthread_mutex_destroy(&q->mu);
}

static int grow(pdkv_cq *q) {
    uint32_t ncap = q->cap * 2;
    pdkv_completion *n = malloc((size_t)ncap * sizeof(*n));
    if (!n) return -ENOMEM;
    for (uint32_t i = 0; i < q->count; i++) n[i] = q->ring[(q->head + i) % q->cap];
    free(q->ring);
    q->ring = n;
    q->cap = ncap;
    q->head = 0;
    return 0;
}

int pdkv_cq_push(pdkv_cq *q, const pdkv_completion *c) {
    pthread_mutex_lock(&q->mu);
    if (q->count == q->cap && grow(q) < 0) {
        pthread_mutex_unlock(&q->mu);
        return -ENOMEM;
    }
    q->ring[(q->head + q->count) % q->cap] = *c;
    int was_empty = q->count++ == 0;
    pthread_mutex_unlock(&q->mu);
    if (was_empty) {
        uint64_t one = 1;
        ssize_t r = write(q->efd, &one, sizeof(one));
        (void)r; /* EAGAIN only when the counter is saturated: it is readable then anyway */
    }
    return 0;
}

int pdkv_cq_push_n(pdkv_cq *q, const pdkv_completion *c, int n) {
    if (n <= 0) return 0;
    pthread_mutex_lock(&q->mu);
    while (q->count + (uint32_t)n > q->cap) {
        if (grow(q) < 0) {
            pthread_mutex_unlock(&q->mu);
            return -ENOMEM;
        }
    }
    int was_empty = q->count == 0;
    for (int i = 0; i < n; i++) q->ring[(q->head + q->count + i) % q->cap] = c[i];
    q->count += (uint32_t)n;
    pthread_mutex_unlock(&q->mu);
    if (was_empty) {
        uint64_t one = 1;
        ssize_t r = write(q->efd, &one, sizeof(one));
        (void)r;
    }
    return 0;
}

int pdkv_cq_vpushf(pdkv_cq *q, uint32_t kind, uint64_t wr_id, uint64_t peer, uint64_t len,
                   int32_t status, uint32_t imm, const char *fmt, va_list ap) {
    pdkv_completion c;
    c.kind = kind;
    c.imm = imm;
    c.wr_id = wr_id;
    c.peer = peer;
    c.len = len;
    c.status = status;
    c.reason[0] = 0;
    if (fmt) vsnprintf(c.reason, sizeof(c.reason), fmt, ap);
    return pdkv_cq_push(q, &c);
}

int pdkv_cq_pushf(pdkv_cq *q, uint32_t kind, uint64_t wr_id, uint64_t peer, uint64_t len,
                  int32_t status, uint32_t imm, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = pdkv_cq_vpushf(q, kind, wr_id, peer, len, status, imm, fmt, ap);
    va_end(ap);
    return rc;
}

int pdkv_cq_poll(pdkv_cq *q, pdkv_completion *out, int max) {
    pthread_mutex_lock(&q->mu);
    int n = 0;
    while (n < max && q->count > 0) {
        out[n++] = q->ring[q->head];
        q->head = (q->head + 1) % q->cap;
        q->count--;
    }
    pthread_mutex_unlock(&q->mu);
    return n;
}

void pdkv_cq_reset(pdkv_cq *q) {
    uint64_t v;
    ssize_t r = read(q->efd, &v, sizeof(v));
    (void)r;
}

int pdkv_seterr(char *buf, size_t n, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, n, fmt, ap);
    va_end(ap);
    return code;
}
