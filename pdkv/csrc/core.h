/* The transport-blind messenger core.
 *
 * Owns one transport and one poller thread. The poller (no GIL, plain C):
 *   - drains the transport's completions: remote immediates are counted per imm value, local
 *     write completions are summed per batch;
 *   - watches 64-bit counters in memory and, when a counter reaches a value, posts the page
 *     batches queued for it (a prefill layer's pages leave as soon as the layer is done);
 *   - spins for spin_us, then sched_yield()s, then sleeps sleep_us at a time while batches are
 *     queued; with nothing queued it blocks on the transport's eventfd (0% CPU when idle).
 * Results reach Python as pdkv_event records behind an eventfd (asyncio add_reader + drain).
 *
 * All functions are thread-safe and never touch Python; error codes are negative errno values
 * with a reason written into `err` (PDKV_ERR_MAX bytes).
 */
#ifndef PDKV_CORE_H
#define PDKV_CORE_H

#include <stdint.h>

#include "transport.h"

enum pdkv_event_kind {
    PDKV_EV_BATCH_DONE = 1, /* every write of batch `tag` completed locally (num_errors failed) */
    PDKV_EV_IMM_DONE = 2,   /* `count` writes carrying `imm` landed: exactly once per expect() */
    PDKV_EV_ERROR = 3,      /* connection-level failure, or more writes for imm than expected */
};

typedef struct pdkv_event {
    uint32_t kind;
    uint32_t imm;
    uint64_t tag;        /* BATCH_DONE: the caller's tag */
    uint64_t peer;
    uint64_t count;      /* writes in the batch / writes counted for imm */
    uint64_t bytes;
    uint32_t num_errors; /* BATCH_DONE: writes that failed */
    int32_t status;      /* 0, or the first failure's negative errno */
    char reason[PDKV_REASON_MAX];
} pdkv_event;

/* A page batch: one write per (page, segment).
 * write (i, s): src = lkey @ src_off + src_pages[i]*src_page_stride + s*src_seg_stride
 *               dst = rkey @ dst_off + dst_pages[i]*dst_page_stride + s*dst_seg_stride
 *               len = seg_len
 * E.g. HND pages [2, H, P, D] of one layer, a rank's heads [h0, h0+n): seg_len = n*P*D*elt,
 * num_segs = 2 (K, V), seg_stride = H*P*D*elt, *_off = layer base + h0*P*D*elt. */
typedef struct pdkv_page_batch {
    uint64_t lkey, rkey;
    uint64_t src_off, dst_off;
    uint64_t src_page_stride, dst_page_stride;
    uint64_t src_seg_stride, dst_seg_stride;
    uint64_t seg_len;
    uint32_t num_segs;
    uint32_t num_pages;
    const int64_t *src_pages; /* [num_pages] */
    const int64_t *dst_pages; /* [num_pages] */
    uint32_t imm;
    uint32_t has_imm;
} pdkv_page_batch;

typedef struct pdkv_core_opts {
    uint32_t spin_us;  /* busy-poll this long after the last work before backing off */
    uint32_t yield_us; /* then sched_yield() this long */
    uint32_t sleep_us; /* then sleep this long per poll while batches are queued */
    const int *cpus;   /* pin the poller to these CPUs (NULL: no pinning) */
    int num_cpus;
} pdkv_core_opts;

typedef struct pdkv_core_stats {
    uint64_t polls;            /* poller loop iterations */
    uint64_t posted_batches;   /* batches posted by the poller from a counter */
    uint64_t last_post_poll;   /* value of `polls` when it last posted a queued batch */
    uint64_t writes_posted;
    uint64_t writes_done;
    uint64_t imms;             /* immediates seen */
    uint64_t sleeps, blocks;   /* backoff: short sleeps, blocking waits */
    uint64_t queued;           /* batches waiting for their counter */
} pdkv_core_stats;

typedef struct pdkv_core pdkv_core;

/* Takes ownership of t (destroyed by pdkv_core_destroy, or here on failure). */
pdkv_core *pdkv_core_create(pdkv_transport *t, const pdkv_core_opts *o, char *err, size_t errlen);
/* Stops the poller, destroys the transport (its threads, fds), frees everything. */
void pdkv_core_destroy(pdkv_core *c);
pdkv_transport *pdkv_core_transport(pdkv_core *c);
int pdkv_core_event_fd(pdkv_core *c);
/* Reset the eventfd and move up to max events out. */
int pdkv_core_drain(pdkv_core *c, pdkv_event *out, int max);

/* Fire one IMM_DONE when `count` writes with `imm` have landed (arrivals before this count). */
int pdkv_core_expect(pdkv_core *c, uint32_t imm, uint64_t count, char *err);
/* Drop imm's counter; returns the arrivals it had counted, or -ENOENT. */
int64_t pdkv_core_forget(pdkv_core *c, uint32_t imm, char *err);

/* Post a batch now; BATCH_DONE(tag) follows. Returns the number of writes or -errno. */
int64_t pdkv_core_post(pdkv_core *c, uint32_t conn, const pdkv_page_batch *b, uint64_t tag, char *err);

/* Watch *addr (an int64 the caller keeps alive until unwatch/destroy). */
int pdkv_core_watch(pdkv_core *c, const int64_t *addr, uint32_t *id, char *err);
/* Queued batches of the watch end with BATCH_DONE status -ECANCELED. */
int pdkv_core_unwatch(pdkv_core *c, uint32_t id, char *err);
/* Post b (page lists copied) once *addr >= value. */
int pdkv_core_queue(pdkv_core *c, uint32_t watch, int64_t value, uint32_t conn,
                    const pdkv_page_batch *b, uint64_t tag, char *err);
/* Deregister a region: -EBUSY while queued batches or in-flight writes use it. */
int pdkv_core_dereg(pdkv_core *c, uint64_t key, char *err);

void pdkv_core_get_stats(pdkv_core *c, pdkv_core_stats *s);

#endif
