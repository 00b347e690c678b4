/* Loopback verbs device: shared state of the userspace libibverbs.so.1 used by the tests.
 *
 * This is test infrastructure, loaded only into test child processes via LD_LIBRARY_PATH. It
 * provides the libibverbs entry points that pdkv/csrc/verbs*.c calls and fills the ibv_context
 * ops (post_send, post_recv, post_srq_recv, poll_cq, req_notify_cq) that verbs.h dispatches
 * inline. RC WRITE / WRITE_WITH_IMM travel between processes over abstract Unix sockets: each
 * process has one listener ("pdkv-loopverbs-<pid>"); a QP that reaches RTS connects to the
 * listener of the process named in its destination GID (::ffff:127.<pid>) and streams frames
 * (header + payload) from a sender thread, so ibv_post_send never blocks, as on a NIC. The
 * target checks rkey, PD (the MR's PD must be the responder QP's: per-peer PDs isolate peers),
 * access flags and bounds BEFORE placing a byte, receives the payload
 * straight into the MR, consumes a posted receive for an immediate, and acks. A NAK (bad
 * rkey/bounds/access, receiver not ready) or a dead peer puts the requester QP into the error
 * state and flushes its outstanding work requests, as real RC does.
 *
 * Files: lv_objects.c (devices, contexts, PDs, MRs), lv_cq.c (CQs, channels, SRQs, async
 * events), lv_qp.c (QP state machine), lv_send.c (requester), lv_wire.c (sockets, responder),
 * lv_abi.c (what else pyverbs and librdmacm bind: queries, and verbs answered EOPNOTSUPP).
 *
 * One process-wide mutex (g_mu) guards every object; payload copies run outside it while the
 * MR is pinned by a busy count (dereg waits for it), so dereg never frees under a landing write.
 *
 * Fault hooks (PDKV_LOOPBACK_FAULTS, comma-separated, read once):
 *   cq_error_after=N     after N completions a CQ raises IBV_EVENT_CQ_ERR and delivers nothing
 *                        more (what an overrun does);
 *   poll_error_after=N   after N completions ibv_poll_cq on that CQ returns -EIO;
 *   flush_signaled_only  a broken QP flushes only its signaled WRs (as some providers do: an
 *                        unsignaled WR then gets no completion at all);
 *   dereg_busy_nic=K     ibv_dereg_mr of an MR on the K-th device (1-based; -1: any) fails with EBUSY and
 *                        leaves it registered (what a provider says while it still uses the MR),
 *                        dereg_busy_times=T times (default 1), only for MRs of dereg_busy_len=L
 *                        bytes when that is given, after the first dereg_busy_skip=S such
 *                        deregistrations succeeded (default 0: e.g. 1 spares a region's own MR
 *                        and hits its per-peer MR of the same length);
 *   port_down=K          the K-th device's port (1-based) reports DOWN / Disabled;
 *   reg_enomem_len=L     registering exactly L bytes fails with ENOMEM (what the kernel says
 *                        when it cannot pin the pages: RLIMIT_MEMLOCK, a memory cgroup).
 *
 * Counters: pdkv_loopback_counters(name, out[4]) -> tx writes, tx bytes, rx writes, rx bytes of
 *   the device (what the port counters of a NIC tell; test-only export).
 *   pdkv_loopback_objects(name, out[2]) -> the device's live MRs and QPs (test-only export).
 *
 * dma-buf (test stand-in): ibv_reg_dmabuf_mr mmaps the fd (MAP_SHARED) and registers that
 *   mapping, so an ordinary fd that can be mmapped (a memfd) stands in for a GPU's dma-buf: a
 *   write lands in the fd's pages, which the test reads through its own mapping. An fd that
 *   cannot be mapped fails as a dma-buf a NIC cannot import does (errno from mmap).
 *   PDKV_LOOPBACK_FAULTS=no_dmabuf makes every ibv_reg_dmabuf_mr fail with EOPNOTSUPP and
 *   no_peermem makes ibv_reg_mr on an address outside this process's mappings fail with EFAULT
 *   (what a kernel without a peer-memory client says for a device pointer).
 *
 * Known differences from hardware: a stopped target process stops acking (a real NIC acks for
 * a stopped process); CQs grow instead of overrunning; one port per device.
 */
#ifndef LV_INTERNAL_H
#define LV_INTERNAL_H

#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdint.h>

#define LV_MAGIC 0x4c564231u /* "LVB1" */
#define LV_MAX_DEVICES 16
#define LV_RNR_WAIT_MS 2000 /* how long a target waits for a posted receive (rnr_retry=7) */

extern pthread_mutex_t g_mu;
extern pthread_cond_t g_cond; /* broadcast when an MR busy count drops or a receive is posted */

struct lv_context {
    struct ibv_context ctx;
    int async_pipe[2];
    struct ibv_async_event events[64];
    int num_events;
};

struct lv_pd { struct ibv_pd pd; };

struct lv_mr {
    struct ibv_mr mr;
    uint64_t iova;
    int access;
    int busy; /* payload copies in progress */
    void *map;      /* ibv_reg_dmabuf_mr: the provider's own mapping of the fd, unmapped at dereg */
    size_t map_len;
    struct lv_mr *next;
};

struct lv_cq {
    struct ibv_cq cq;
    struct ibv_wc *ring;
    int cap, head, count;
    int armed;
    int overrun_reported;
    long pushed;  /* completions ever pushed (fault hooks count them) */
    int failed;   /* 1: CQ_ERR raised, the CQ stalls; 2: ibv_poll_cq fails */
};

struct lv_rq { /* a receive queue: posted wr_ids */
    uint64_t *ids;
    int cap, head, count;
};

struct lv_srq { struct ibv_srq srq; struct lv_rq rq; int max_wr; };

struct lv_wr { /* an outstanding send work request */
    uint64_t seq, wr_id, len;
    int signaled, opcode;
    int status; /* nonzero: fails when it reaches the head (a local error found at post) */
};

struct lv_job { /* one WRITE frame waiting for the QP's sender thread */
    uint64_t seq;
    struct ibv_send_wr wr;  /* copy; sg_list points at sg below */
    struct ibv_sge sg[16];
    struct lv_mr *mrs[16];  /* pinned (busy) until sent */
    struct lv_job *next;
};

struct lv_qp {
    struct ibv_qp qp;
    int access;            /* qp_access_flags */
    uint32_t dest_qpn;
    union ibv_gid dgid;
    uint16_t dlid;
    int is_global;
    struct lv_rq rq;       /* used when the QP has no SRQ */
    int max_send_wr;
    struct lv_wr *out;     /* outstanding WRs, ring of max_send_wr */
    int out_head, out_count;
    uint64_t next_seq;
    int sock;              /* stream to the target process, -1 before RTS or when unreachable */
    int peer_dead;         /* the stream broke: new sends fail with retry-exceeded */
    int err_pending;       /* a WR failed locally: later WRs are not sent */
    int destroying;
    int sq_sig_all, max_recv_wr;
    /* post_send never blocks (like a NIC): frames go to a sender thread, acks to a reader */
    struct lv_job *jobs, *jobs_tail;
    pthread_cond_t jobs_cond;
    int threads_started;
    pthread_t ack_thread, tx_thread;
    struct lv_qp *next;
};

/* Wire formats (host byte order: both ends are on this machine). */
struct lv_hello { uint32_t magic, dst_qpn, src_qpn, pad; };
struct lv_frame { uint64_t seq, raddr, len; uint32_t rkey, has_imm, imm_be, pad; };
struct lv_ack { uint64_t seq; uint32_t status, pad; };

/* fault hooks (lv_objects.c): the value of `name` in PDKV_LOOPBACK_FAULTS, 1 for a bare flag,
 * 0 if absent */
long lv_fault(const char *name);
long lv_num_qps(struct ibv_device *dev); /* lv_qp.c, caller holds g_mu */

/* Per-device traffic, counted by the device itself (a NIC's port counters): writes this
 * process's QPs of the device sent, and writes that landed through its responder QPs. Read by
 * tests with pdkv_loopback_counters() (ctypes, in the process that loaded the device).
 * Called with g_mu held. */
void lv_count(struct ibv_device *dev, int rx, uint64_t bytes);

/* objects (lv_objects.c) */
struct lv_mr *lv_find_mr_rkey(uint32_t rkey);
struct lv_mr *lv_find_mr_lkey(uint32_t lkey);
void lv_cq_push(struct lv_cq *cq, const struct ibv_wc *wc);
void lv_cq_purge_qp(struct lv_cq *cq, uint32_t qpn);
int lv_rq_push(struct lv_rq *rq, uint64_t wr_id, int max);
int lv_rq_pop(struct lv_rq *rq, uint64_t *wr_id);
void lv_async_event(struct ibv_context *ctx, enum ibv_event_type type, struct ibv_qp *qp);
void lv_async_purge_qp(struct ibv_context *ctx, struct ibv_qp *qp);

/* queue pairs (lv_qp.c) */
struct lv_qp *lv_find_qp(uint32_t qpn);
int lv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);

/* requester side (lv_send.c) */
void lv_qp_fail(struct lv_qp *q, enum ibv_wc_status first);
int lv_start_requester(struct lv_qp *q);
void lv_stop_requester(struct lv_qp *q);
int lv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
int lv_post_srq_recv(struct ibv_srq *srq, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);

/* wire (lv_wire.c) */
int lv_link_is_ib(void);
uint16_t lv_local_lid(void);
void lv_local_gid(union ibv_gid *gid);
int lv_connect_lid(uint16_t lid);
int lv_listener_acquire(void);
void lv_listener_release(void);
int lv_connect_gid(const union ibv_gid *gid);
int lv_read_full(int fd, void *buf, size_t len);
int lv_write_full(int fd, const void *buf, size_t len);

#endif
