/* Messenger core, batches: local-completion records per batch, page-batch expansion and
 * posting, counter watches and the batches queued on them (see core.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core_internal.h"

#define WRITE_CHUNK 256 /* writes expanded on the stack per transport post */
#define seterr pdkv_core_seterr
#define emit pdkv_core_emit

/* ---- posting ---- */

/* Offsets of write (i, s); 0 or -EOVERFLOW / -EINVAL. */
static int write_at(const pdkv_page_batch *b, uint32_t i, uint32_t s, uint64_t *lo, uint64_t *ro) {
    int64_t sp = b->src_pages[i], dp = b->dst_pages[i];
    uint64_t a, x;
    if (sp < 0 || dp < 0) return -EINVAL;
    if (__builtin_mul_overflow((uint64_t)sp, b->src_page_stride, &a) || __builtin_add_overflow(a, b->src_off, &a) ||
        __builtin_mul_overflow((uint64_t)s, b->src_seg_stride, &x) || __builtin_add_overflow(a, x, lo))
        return -EOVERFLOW;
    if (__builtin_mul_overflow((uint64_t)dp, b->dst_page_stride, &a) || __builtin_add_overflow(a, b->dst_off, &a) ||
        __builtin_mul_overflow((uint64_t)s, b->dst_seg_stride, &x) || __builtin_add_overflow(a, x, ro))
        return -EOVERFLOW;
    return 0;
}

static int validate(const pdkv_page_batch *b, char *err) {
    if (b->num_segs == 0) {
        seterr(err, "a page batch needs num_segs >= 1");
        return -EINVAL;
    }
    uint64_t lo, ro;
    for (uint32_t i = 0; i < b->num_pages; i++) {
        int rc = write_at(b, i, b->num_segs - 1, &lo, &ro);
        if (rc == -EINVAL) {
            seterr(err, "page %u: negative page index (src %lld, dst %lld)", i, (long long)b->src_pages[i],
                   (long long)b->dst_pages[i]);
            return rc;
        }
        if (rc < 0 || lo + b->seg_len < lo || ro + b->seg_len < ro) {
            seterr(err, "page %u: offset overflows 64 bits (src page %lld, dst page %lld)", i,
                   (long long)b->src_pages[i], (long long)b->dst_pages[i]);
            return -EOVERFLOW;
        }
    }
    return 0;
}

int64_t pdkv_core_post_internal(pdkv_core *c, uint32_t conn, const pdkv_page_batch *b, uint64_t tag,
                                int event_on_failure, char *err) {
    char why[PDKV_ERR_MAX];
    int rc = validate(b, why);
    uint64_t wr_id;
    pthread_mutex_lock(&c->mu);
    batch_rec *r0 = pdkv_rec_alloc(c, tag, &wr_id);
    pthread_mutex_unlock(&c->mu);
    /* NOTE: recs[] may be reallocated by other posters: re-derive the record under mu. */
#define r (&c->recs[(uint32_t)wr_id - 1])
    if (!r0) {
        seterr(err, "out of memory");
        return -ENOMEM;
    }
    uint64_t total = (uint64_t)b->num_pages * b->num_segs, posted = 0;
    pdkv_write w[WRITE_CHUNK];
    uint32_t i = 0, s = 0;
    while (rc == 0 && posted < total) {
        int k = 0;
        for (; k < WRITE_CHUNK && i < b->num_pages; k++) {
            pdkv_write *x = &w[k];
            write_at(b, i, s, &x->loff, &x->roff);
            x->lkey = b->lkey;
            x->rkey = b->rkey;
            x->len = b->seg_len;
            x->wr_id = wr_id;
            x->imm = b->imm;
            x->has_imm = b->has_imm;
            if (++s == b->num_segs) {
                s = 0;
                i++;
            }
        }
        pthread_mutex_lock(&c->mu);
        r->remaining += k;
        r->total += k;
        pthread_mutex_unlock(&c->mu);
        int n = c->t->ops->post(c->t, conn, w, k);
        if (n < 0) {
            rc = n;
            snprintf(why, sizeof(why), "%s", c->t->ops->last_error(c->t));
            pthread_mutex_lock(&c->mu);
            r->remaining -= k;
            r->total -= k;
            pthread_mutex_unlock(&c->mu);
            break;
        }
        posted += k;
    }
    __atomic_add_fetch(&c->st.writes_posted, posted, __ATOMIC_RELAXED);
    pthread_mutex_lock(&c->mu);
    if (rc < 0 && posted == 0 && !event_on_failure) {
        r->in_use = 0; /* nothing left: the caller gets the error, no event follows */
        pthread_mutex_unlock(&c->mu);
        seterr(err, "%s", why);
        return rc;
    }
    if (rc < 0) {
        r->total = total;
        pdkv_rec_fail(r, rc, why, total - posted);
    }
    pdkv_rec_release(c, r);
    pthread_mutex_unlock(&c->mu);
    return (int64_t)posted;
#undef r
}

int64_t pdkv_core_post(pdkv_core *c, uint32_t conn, const pdkv_page_batch *b, uint64_t tag, char *err) {
    return pdkv_core_post_internal(c, conn, b, tag, 0, err);
}

/* ---- watches and queued batches ---- */

int pdkv_core_watch(pdkv_core *c, const int64_t *addr, uint32_t *id, char *err) {
    if (!addr || ((uintptr_t)addr & 7)) {
        seterr(err, "a watched counter must be a non-null, 8-byte aligned int64");
        return -EINVAL;
    }
    pthread_mutex_lock(&c->mu);
    for (uint32_t i = 0; i < PDKV_MAX_WATCHES; i++) {
        if (!c->watches[i].addr) {
            c->watches[i].addr = addr;
            c->watches[i].head = NULL;
            *id = i;
            pthread_mutex_unlock(&c->mu);
            return 0;
        }
    }
    pthread_mutex_unlock(&c->mu);
    seterr(err, "too many watched counters (max %d)", PDKV_MAX_WATCHES);
    return -ENOSPC;
}

int pdkv_core_unwatch(pdkv_core *c, uint32_t id, char *err) {
    pthread_mutex_lock(&c->mu);
    if (id >= PDKV_MAX_WATCHES || !c->watches[id].addr) {
        pthread_mutex_unlock(&c->mu);
        seterr(err, "unknown watch %u", id);
        return -ENOENT;
    }
    queued_batch *q = c->watches[id].head;
    c->watches[id].addr = NULL;
    c->watches[id].head = NULL;
    while (q) {
        queued_batch *next = q->next;
        pdkv_event e = {.kind = PDKV_EV_BATCH_DONE, .tag = q->tag,
                        .count = (uint64_t)q->b.num_pages * q->b.num_segs,
                        .num_errors = q->b.num_pages * q->b.num_segs, .status = -ECANCELED};
        snprintf(e.reason, sizeof(e.reason), "counter watch %u removed before value %lld", id,
                 (long long)q->value);
        emit(c, &e);
        __atomic_sub_fetch(&c->num_queued, 1, __ATOMIC_RELEASE);
        free(q);
        q = next;
    }
    pthread_mutex_unlock(&c->mu);
    return 0;
}

int pdkv_core_queue(pdkv_core *c, uint32_t id, int64_t value, uint32_t conn, const pdkv_page_batch *b,
                    uint64_t tag, char *err) {
    int rc = validate(b, err);
    if (rc < 0) return rc;
    queued_batch *q = malloc(sizeof(*q) + 2 * (size_t)b->num_pages * sizeof(int64_t));
    if (!q) {
        seterr(err, "out of memory");
        return -ENOMEM;
    }
    q->value = value;
    q->conn = conn;
    q->tag = tag;
    q->b = *b;
    memcpy(q->pages, b->src_pages, b->num_pages * sizeof(int64_t));
    memcpy(q->pages + b->num_pages, b->dst_pages, b->num_pages * sizeof(int64_t));
    q->b.src_pages = q->pages;
    q->b.dst_pages = q->pages + b->num_pages;
    pthread_mutex_lock(&c->mu);
    if (id >= PDKV_MAX_WATCHES || !c->watches[id].addr) {
        pthread_mutex_unlock(&c->mu);
        free(q);
        seterr(err, "unknown watch %u", id);
        return -ENOENT;
    }
    queued_batch **p = &c->watches[id].head;
    while (*p && (*p)->value <= value) p = &(*p)->next; /* FIFO among equal values */
    q->next = *p;
    *p = q;
    __atomic_add_fetch(&c->num_queued, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&c->mu);
    pdkv_core_wake(c);
    return 0;
}

/* A batch's source names the region through any of its keys (verbs: one per NIC). */
static int same_region(pdkv_transport *t, uint64_t a, uint64_t b) {
    return a == b || (t->ops->same_region && t->ops->same_region(t, a, b));
}

int pdkv_core_dereg(pdkv_core *c, uint64_t key, char *err) {
    pthread_mutex_lock(&c->mu);
    for (uint32_t i = 0; i < PDKV_MAX_WATCHES; i++)
        for (queued_batch *q = c->watches[i].head; q; q = q->next)
            if (same_region(c->t, q->b.lkey, key)) {
                pthread_mutex_unlock(&c->mu);
                seterr(err, "region 0x%llx is the source of a batch queued on counter %u",
                       (unsigned long long)key, i);
                return -EBUSY;
            }
    pthread_mutex_unlock(&c->mu);
    int rc = c->t->ops->dereg(c->t, key);
    if (rc < 0) seterr(err, "%s", c->t->ops->last_error(c->t));
    return rc;
}
