/* Completion queue shared by the transports: a growable ring of pdkv_completion behind a mutex,
 * plus an eventfd that is readable whenever the ring may hold something.
 *
 * The eventfd is written only when the ring goes from empty to non-empty, so a busy producer
 * costs one syscall per burst, not per completion. A consumer must therefore: read (reset) the
 * eventfd, then poll until empty, and only then block on the fd.
 */
#ifndef PDKV_CQ_H
#define PDKV_CQ_H

#include <pthread.h>
#include <stdarg.h>

#include "transport.h"

typedef struct pdkv_cq {
    pthread_mutex_t mu;
    pdkv_completion *ring;
    uint32_t cap, head, count; /* ring[head .. head+count) mod cap */
    int efd;
} pdkv_cq;

int pdkv_cq_init(pdkv_cq *q); /* 0 or -errno */
void pdkv_cq_destroy(pdkv_cq *q);
/* Push one completion (copied). Returns 0 or -ENOMEM. */
int pdkv_cq_push(pdkv_cq *q, const pdkv_completion *c);
/* Push n completions under one lock (a sender's burst). */
int pdkv_cq_push_n(pdkv_cq *q, const pdkv_completion *c, int n);
/* Convenience: push a completion of `kind` with a printf-style reason. */
int pdkv_cq_pushf(pdkv_cq *q, uint32_t kind, uint64_t wr_id, uint64_t peer, uint64_t len,
                  int32_t status, uint32_t imm, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));
/* The same with a va_list (a transport's own printf-style error helper forwards to it). */
int pdkv_cq_vpushf(pdkv_cq *q, uint32_t kind, uint64_t wr_id, uint64_t peer, uint64_t len,
                   int32_t status, uint32_t imm, const char *fmt, va_list ap);
/* Move up to max completions out; returns how many. Non-blocking. */
int pdkv_cq_poll(pdkv_cq *q, pdkv_completion *out, int max);
/* Reset the eventfd (non-blocking read); call before draining. */
void pdkv_cq_reset(pdkv_cq *q);

/* snprintf into a transport's last-error buffer; returns `code` so callers can `return seterr(...)`. */
int pdkv_seterr(char *buf, size_t n, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

#endif
