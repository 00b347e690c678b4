/* Messenger core: per-batch completion records. A posted batch's writes all carry the wr_id of
 * one record; the record emits BATCH_DONE when its last write completes (see core_internal.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core_internal.h"

/* ---- batch records (caller holds mu) ---- */

batch_rec *pdkv_rec_alloc(pdkv_core *c, uint64_t tag, uint64_t *wr_id) {
    uint32_t i;
    for (i = 0; i < c->num_recs; i++) {
        uint32_t j = (c->free_hint + i) % c->num_recs;
        if (!c->recs[j].in_use) {
            i = j;
            goto found;
        }
    }
    {
        uint32_t ncap = c->num_recs ? c->num_recs * 2 : 64;
        batch_rec *n = realloc(c->recs, (size_t)ncap * sizeof(*n));
        if (!n) return NULL;
        memset(n + c->num_recs, 0, (size_t)(ncap - c->num_recs) * sizeof(*n));
        i = c->num_recs;
        c->recs = n;
        c->num_recs = ncap;
    }
found:;
    batch_rec *r = &c->recs[i];
    uint32_t gen = r->gen + 1;
    memset(r, 0, sizeof(*r));
    r->gen = gen;
    r->in_use = 1;
    r->tag = tag;
    r->remaining = 1; /* held by the poster until every chunk is posted */
    c->free_hint = i + 1;
    *wr_id = ((uint64_t)gen << 32) | (i + 1);
    return r;
}

batch_rec *pdkv_rec_find(pdkv_core *c, uint64_t wr_id) {
    uint32_t i = (uint32_t)wr_id;
    if (i == 0 || i > c->num_recs) return NULL;
    batch_rec *r = &c->recs[i - 1];
    return (r->in_use && r->gen == (uint32_t)(wr_id >> 32)) ? r : NULL;
}

void pdkv_rec_release(pdkv_core *c, batch_rec *r) {
    if (--r->remaining) return;
    pdkv_event e = {.kind = PDKV_EV_BATCH_DONE, .tag = r->tag, .peer = r->peer, .count = r->total,
                    .bytes = r->bytes, .num_errors = r->num_errors, .status = r->status};
    memcpy(e.reason, r->reason, sizeof(e.reason));
    pdkv_core_emit(c, &e);
    r->in_use = 0;
}

void pdkv_rec_fail(batch_rec *r, int32_t status, const char *reason, uint64_t n) {
    if (!r->status) {
        r->status = status;
        snprintf(r->reason, sizeof(r->reason), "%s", reason);
    }
    r->num_errors += (uint32_t)n;
}

