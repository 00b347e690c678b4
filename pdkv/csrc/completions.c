/* Messenger core, arrivals: immediate counters (expect/forget) and the handling of transport
 * completions (remote immediates counted, local write completions summed per batch record). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core_internal.h"

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

