/* Private state of the messenger core, shared by its files (order below). Not part of the API. */
#ifndef PDKV_CORE_INTERNAL_H
#define PDKV_CORE_INTERNAL_H

#include <pthread.h>

#include "core.h"

#define PDKV_IMM_BUCKETS 4096
#define PDKV_MAX_WATCHES 64

/* Writes counted for one immediate value; removed when its expected count fires. */
typedef struct imm_node {
    uint32_t imm;
    uint64_t expected; /* 0: not expected yet (early arrivals are kept) */
    uint64_t arrived, bytes, peer;
    struct imm_node *next;
} imm_node;

/* Local completions of one posted batch; wr_id = (gen << 32) | (index + 1). */
typedef struct batch_rec {
    uint64_t tag, peer;
    uint64_t total, remaining, bytes;
    uint32_t gen, in_use, num_errors;
    int32_t status;
    char reason[PDKV_REASON_MAX];
} batch_rec;

typedef struct queued_batch {
    int64_t value;
    uint32_t conn;
    uint64_t tag;
    pdkv_page_batch b; /* src_pages/dst_pages point into pages[] */
    struct queued_batch *next;
    int64_t pages[]; /* src pages then dst pages */
} queued_batch;

typedef struct watch {
    const int64_t *addr; /* NULL: free */
    queued_batch *head;  /* sorted by value */
} watch;

struct pdkv_core {
    pdkv_transport *t;
    pdkv_core_opts opts;
    int cpus[64];
    pthread_t thread;
    int thread_started;
    int wake_fd, out_fd;
    int stop; /* atomic */
    pthread_mutex_t mu; /* everything below */
    imm_node *imms[PDKV_IMM_BUCKETS];
    batch_rec *recs;
    uint32_t num_recs, free_hint;
    watch watches[PDKV_MAX_WATCHES];
    uint64_t num_queued; /* atomic reads outside mu */
    pdkv_event *ev;
    uint32_t ev_cap, ev_head, ev_count;
    pdkv_core_stats st; /* counters updated with atomics */
};

/* Call order (each file calls only files below it):
 *   core.c (create/destroy) -> poller.c (the thread) -> batch.c (posting, watches),
 *   completions.c (arrivals) -> records.c (batch records) -> events.c (reasons, events, wake). */
/* events.c */
void pdkv_core_seterr(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void pdkv_core_emit(pdkv_core *c, const pdkv_event *e); /* caller holds mu */
void pdkv_core_wake(pdkv_core *c);
/* records.c (caller holds mu) */
batch_rec *pdkv_rec_alloc(pdkv_core *c, uint64_t tag, uint64_t *wr_id);
batch_rec *pdkv_rec_find(pdkv_core *c, uint64_t wr_id);
void pdkv_rec_release(pdkv_core *c, batch_rec *r); /* one write done: BATCH_DONE at the last */
void pdkv_rec_fail(batch_rec *r, int32_t status, const char *reason, uint64_t n);
/* completions.c */
void pdkv_core_handle(pdkv_core *c, const pdkv_completion *cp, int n);
/* batch.c */
int64_t pdkv_core_post_internal(pdkv_core *c, uint32_t conn, const pdkv_page_batch *b, uint64_t tag,
                                int event_on_failure, char *err);
/* poller.c */
void *pdkv_poller_main(void *arg);

#endif
