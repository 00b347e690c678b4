/* pdkv verbs transport, leaf: the per-thread error reason and the queue of pdkv completions
 * that poll() hands to the core. Every other verbs file calls these; they call nothing.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Per thread, so the progress thread and a Python thread posting at once don't mix their
 * reasons (the same rule as tcp_net.c). */
static __thread char tls_err[PDKV_ERR_MAX]; /* the longest: a busy dereg naming every NIC */

const char *vb_errbuf(void) { return tls_err; }
void vb_clear_error(void) { tls_err[0] = 0; }

void vb_fail(vb_transport *t, const char *fmt, ...)
{
    va_list ap;
    (void)t;
    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof tls_err, fmt, ap);
    va_end(ap);
}

/* Called with t->mu held. */
void vb_push(vb_transport *t, const pdkv_completion *c)
{
    if (t->cq_count == t->cq_cap) {
        uint32_t cap = t->cq_cap ? t->cq_cap * 2 : 256;
        pdkv_completion *ring = malloc(cap * sizeof *ring);
        if (!ring)
            return; /* out of memory: the completion is lost, the eventfd still fires */
        for (uint32_t i = 0; i < t->cq_count; i++)
            ring[i] = t->cq_ring[(t->cq_head + i) % t->cq_cap];
        free(t->cq_ring);
        t->cq_ring = ring;
        t->cq_head = 0;
        t->cq_cap = cap;
    }
    t->cq_ring[(t->cq_head + t->cq_count++) % t->cq_cap] = *c;
    uint64_t one = 1;
    if (write(t->efd, &one, sizeof one) < 0) {
        /* counter saturated: it is readable anyway */
    }
}

void vb_push_error(vb_transport *t, uint64_t wr_id, uint64_t peer, int status, const char *fmt, ...)
{
    pdkv_completion c;
    memset(&c, 0, sizeof c);
    c.kind = PDKV_CQ_ERROR;
    c.wr_id = wr_id;
    c.peer = peer;
    c.status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c.reason, sizeof c.reason, fmt, ap);
    va_end(ap);
    vb_push(t, &c);
}

#endif /* PDKV_HAVE_VERBS */
