/* Messenger core, leaf: error reasons, the event queue behind the eventfd, and waking the
 * poller. Every other core file calls these; they call nothing (see core_internal.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core_internal.h"

void pdkv_core_seterr(char *err, const char *fmt, ...) {
    if (!err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, PDKV_ERR_MAX, fmt, ap);
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

void pdkv_core_wake(pdkv_core *c) {
    uint64_t one = 1;
    ssize_t r = write(c->wake_fd, &one, sizeof(one));
    (void)r;
}

