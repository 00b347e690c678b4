/* Internal state of the verbs transport (verbs*.c; the call order is below).
 * Only compiled when libibverbs is present (PDKV_HAVE_VERBS). */
#ifndef PDKV_VERBS_INTERNAL_H
#define PDKV_VERBS_INTERNAL_H

#include "transport.h"

#include <infiniband/verbs.h>
#include <pthread.h>

#define VB_MAX_QPS 16          /* qps_per_peer limit */
#define VB_MAX_CONNS 1024
#define VB_SQ_DEPTH 1024       /* send WRs per QP (capped by the device's max_qp_wr) */
#define VB_SRQ_DEPTH 4096      /* zero-length receives kept posted (capped by max_srq_wr) */
#define VB_SIGNAL_EVERY 64     /* signal at least every N WRs so the SQ never fills */
#define VB_SPIN_POLLS 256      /* empty CQ polls before the progress thread sleeps */
#define VB_RNR_RETRY 6         /* bounded: 7 means retry receiver-not-ready forever */
#define VB_RECV_ID UINT64_MAX  /* wr_id of every receive; sends use sequence numbers */
#define VB_INFO_MAGIC 0x766b6470u /* "pdkv" */
#define VB_INFO_VERSION 1
#define VB_MAX_REGIONS 1024    /* registered regions (the key has 16 bits for the index) */
#define VB_MAX_DOMAINS 256     /* peers with a protection domain of their own (isolate_peers) */
#define VB_MAX_PGOFF 65536     /* the key has 16 bits for the page offset: pages up to 64 KiB */

/* Keys: [63:48] region index + 1 | [47:32] offset of the region's start in its page | [31:0] rkey.
 * A write to (key, off) goes to iova pgoff + off with that rkey. */
#define VB_KEY(idx, pgoff, rkey) ((uint64_t)((idx) + 1) << 48 | (uint64_t)(pgoff) << 32 | (uint32_t)(rkey))
#define VB_KEY_INDEX(key) ((uint32_t)((key) >> 48))           /* index + 1, 0: none */
#define VB_KEY_PGOFF(key) ((uint64_t)(((key) >> 32) & 0xffff))

typedef struct vb_region {
    struct ibv_mr *mr; /* in t->pd; shared mode: LOCAL+REMOTE_WRITE, isolate_peers: LOCAL only */
    uint8_t *addr;
    uint64_t key, len, pgoff; /* key 0: free slot */
    uint32_t inflight; /* local writes from this region not yet completed */
    /* its own MR is gone but a per-peer or grant MR said EBUSY (verbs_mr.c vb_dereg): it takes
     * no new write or grant, and the next dereg deregisters what is left */
    int dying;
    /* GPU memory registered through a dma-buf (verbs_gpudirect.c): every MR of the region (its
     * own, per-peer local MRs, grants) is an ibv_reg_dmabuf_mr of this fd (our dup, closed at
     * dereg) at dmabuf_off + the MR's offset; addr is then the device pointer (never touched) */
    int dmabuf;
    int dmabuf_fd;
    uint64_t dmabuf_off;
} vb_region;

/* A registration of (part of) a region that one peer may write: the grant itself (the NIC
 * checks rkey, PD and bounds). off/len are region offsets; whole: the entire region. */
typedef struct vb_grant_mr {
    struct ibv_mr *mr;
    uint32_t region;
    int whole;
    uint64_t off, len;
} vb_grant_mr;

/* isolate_peers: one protection domain per peer. Its QPs live in it, so the NIC lets that peer
 * reach only the MRs of this PD: a local-only registration of every region (sources of our
 * writes to the peer) plus the peer's grants. Shared mode: one domain (t->pd) for every peer. */
typedef struct vb_domain {
    int used;
    uint64_t peer;
    struct ibv_pd *pd;
    struct ibv_srq *srq;           /* QPs of one PD share one SRQ of that PD */
    uint32_t num_conns;
    struct ibv_mr **lmr;           /* [VB_MAX_REGIONS] local-only MRs, by region index */
    vb_grant_mr *grants;
    uint32_t num_grants, grants_cap;
} vb_domain;

typedef struct vb_pending { uint64_t wr_id, len; uint32_t region; } vb_pending;

typedef struct vb_qp {
    struct ibv_qp *qp;
    vb_pending *ring;    /* posted, not yet completed WRs; index = seq % sq_depth */
    uint64_t head_seq;   /* oldest outstanding sequence number */
    uint64_t next_seq;
    uint32_t count;      /* outstanding WRs */
    uint32_t psn;
} vb_qp;

typedef struct vb_conn {
    int used, ready, broken;
    uint64_t peer;
    uint32_t domain; /* index into t->domains */
    uint32_t rr; /* round-robin cursor over qps */
    vb_qp qps[VB_MAX_QPS];
    pdkv_write *backlog; /* accepted writes not yet on a send queue (ring) */
    uint32_t bl_head, bl_count, bl_cap;
} vb_conn;

/* Connection data exchanged through the messenger's control channel (native byte order is
 * fine: both ends check magic and version, and RDMA peers share an ABI in practice). */
typedef struct vb_info {
    uint32_t magic, version;
    uint64_t node_id;
    uint8_t gid[16];
    uint16_t lid;
    uint8_t mtu, link_layer;
    uint32_t num_qps;
    uint32_t qpn[VB_MAX_QPS];
    uint32_t psn[VB_MAX_QPS];
} vb_info;

typedef struct vb_transport {
    pdkv_transport base;
    pthread_mutex_t mu;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *channel;
    struct ibv_cq *cq;
    struct ibv_srq *srq;
    uint8_t port_num, link_layer, mtu;
    uint16_t lid;
    int gid_index;
    union ibv_gid gid;
    uint32_t qps_per_peer, sq_depth, srq_depth;
    vb_region *regions;
    uint32_t num_regions;
    int isolate;          /* isolate_peers: a protection domain per peer */
    uint64_t page_size;   /* sysconf(_SC_PAGESIZE): the page offset of keys */
    vb_domain *domains;   /* [VB_MAX_DOMAINS]; shared mode uses domains[0] = t->pd / t->srq */
    vb_conn *conns;
    uint32_t conns_hi; /* conns[conns_hi..] have never been used: lookups stop there */
    pdkv_completion *cq_ring; /* completions waiting for poll() */
    uint32_t cq_head, cq_count, cq_cap;
    int efd, wake_fd;
    int efd_shared;       /* efd belongs to a multi-NIC transport (verbs_multi.h): poll() never
                           * resets it (the core's poller does, before it polls every NIC) */
    pthread_t thread;
    int thread_started, stop;
    int cq_dead;          /* ibv_poll_cq failed or IBV_EVENT_CQ_ERR: every connection is failed */
    uint32_t cq_size;     /* entries of t->cq: resized to what the QPs and SRQs can produce */
    uint32_t max_cqe;     /* the device's limit */
    uint64_t refused_writes; /* a peer's bad write broke our QP (IBV_EVENT_QP_ACCESS_ERR); under mu */
} vb_transport;

/* Call order (each file calls only files below it):
 *   verbs.c (function table, create, destroy) -> verbs_progress.c (the progress thread)
 *   -> verbs_conn.c (QPs) -> verbs_post.c (backlog, posting) -> verbs_mr.c (regions, grants)
 *   -> verbs_domain.c (per-peer protection domains) -> verbs_setup.c (NIC, PD, CQ, SRQ)
 *   -> verbs_report.c (errors, completions for the core). */

/* verbs_report.c */
void vb_fail(vb_transport *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *vb_errbuf(void); /* this thread's last failure reason */
void vb_clear_error(void);
void vb_push(vb_transport *t, const pdkv_completion *c); /* caller holds t->mu */
void vb_push_error(vb_transport *t, uint64_t wr_id, uint64_t peer, int status, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* ibv_dereg_mr's result says the device still uses the MR (providers return EBUSY or -1 + errno) */
static inline int vb_dereg_busy(int e)
{
    return e == EBUSY || (e < 0 && errno == EBUSY);
}

/* verbs_setup.c: device, PD, CQ, SRQ */
int vb_open_device(vb_transport *t, const pdkv_verbs_opts *o);
int vb_set_nonblock(int fd);
int vb_post_recvs(struct ibv_srq *srq, int n);

/* verbs_domain.c: protection domains (caller holds t->mu) */
vb_domain *vb_domain_get(vb_transport *t, uint64_t peer, int create); /* NULL + vb_fail */
void vb_domain_tidy(vb_transport *t, vb_domain *d); /* free it once no conn or grant uses it */
int vb_domain_add_region(vb_transport *t, vb_domain *d, uint32_t region); /* its local MR */
/* every grant and local MR of it; one the device still uses (EBUSY) stays: returns how many */
uint32_t vb_domain_drop_region(vb_transport *t, uint32_t region);
void vb_domain_free(vb_transport *t, vb_domain *d);
uint32_t vb_lkey(vb_transport *t, const vb_conn *c, const vb_region *r); /* for c's QPs */

/* verbs_memreg.c (leaf): an MR over [off, off+len) of region r in pd, iova pgoff + off: a
 * dma-buf registration for dma-buf regions, ibv_reg_mr_iova otherwise (NULL + errno) */
struct ibv_mr *vb_mr_reg(struct ibv_pd *pd, const vb_region *r, uint64_t off, uint64_t len, int access);

/* verbs_gpudirect.c: device memory (GPUDirect RDMA), see transport.h reg_device */
int vb_reg_device(pdkv_transport *t, int fd, uint64_t offset, uint64_t len, void *addr,
                  uint64_t *key_out, uint32_t *method_out);

/* verbs_mr.c: regions and grants */
int vb_reg(pdkv_transport *t, void *addr, uint64_t len, uint64_t *key_out);
/* a slot for region `proto` whose own MR is `mr` (registered by the caller in t->pd, iova
 * proto->pgoff): added to every peer domain, *key_out set; on failure mr is deregistered */
int vb_add_region(vb_transport *t, struct ibv_mr *mr, const vb_region *proto, uint64_t *key_out);
int vb_grant(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t *key_out);
int vb_revoke(pdkv_transport *t, uint64_t key, uint64_t peer);
int vb_grant_range(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                   uint64_t *key_out);
int vb_revoke_range(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len);
int vb_dereg(pdkv_transport *t, uint64_t key);
vb_region *vb_find_region(vb_transport *t, uint64_t key);

/* verbs_post.c: posting through the backlog */
int vb_post(pdkv_transport *t, uint32_t conn, const pdkv_write *w, int n);
void vb_pump(vb_transport *t, vb_conn *c);
void vb_flush_backlog(vb_transport *t, vb_conn *c, int status, const char *why);
/* Put q in ERR and fail every WR still outstanding on it now: a provider may flush only signaled
 * WRs (or nothing, once the CQ failed), so no completion is awaited for them. */
void vb_fail_outstanding(vb_transport *t, vb_conn *c, vb_qp *q, int status, const char *why);

/* verbs_conn.c: connections */
vb_qp *vb_find_qp(vb_transport *t, uint32_t qp_num, vb_conn **conn_out);
int vb_prepare(pdkv_transport *t, uint64_t peer, void *info_out, uint32_t *info_len,
               uint32_t *conn_out);
int vb_complete(pdkv_transport *t, uint32_t conn, const void *info, uint32_t info_len);
int vb_disconnect(pdkv_transport *t, uint32_t conn);
void vb_drop_conn(vb_transport *t, vb_conn *c, const char *why);

/* verbs_progress.c: the progress thread */
int vb_start_progress(vb_transport *t);
void vb_stop_progress(vb_transport *t);

#endif
