/* pdkv verbs over several NICs: one transport (transport.h) made of one single-NIC verbs
 * transport per device (verbs.c), so every NIC of a node carries writes.
 *
 * What each NIC has: its own device context, PD(s) (isolate_peers: one per peer and NIC), CQ,
 * SRQ and progress thread (the single-NIC transport). What is shared: one eventfd that every
 * NIC's progress thread rings, so the core's poller still waits on one fd.
 *
 * Regions are registered on every NIC (the same pinned pages, one MR per NIC), so any NIC may
 * carry a write from or into them. A key names the region AND the NIC that carries the write:
 *   [63:54] region index + 1 | [53:48] NIC index | [47:32] page offset | [31:0] rkey (of that NIC)
 * nic_key() gives a region's key on another NIC. A write from (lkey on local NIC i) to (rkey on
 * remote NIC j) travels on the queue pairs of the pair (i, j): a connection holds one single-NIC
 * connection per (local NIC, remote NIC) pair, set up through one info blob (verbs_multi_conn.c)
 * -- every pair, or (prepare_pairs) only those the layer above says its writes can use: with 8
 * NICs on both sides and rank r's pages on NIC r, 8 pairs instead of 64.
 * The layer above decides the NICs: each rank's pages leave through the NIC nearest its GPU
 * (pdkv/messenger.py, pdkv/topo) by naming that NIC's key.
 *
 * Call order: verbs_multi.c (function table, create, poll, stats) -> verbs.c (creates the
 * single-NIC transport of each device; afterwards they are driven through their function
 * tables), verbs_multi_conn.c (connections) and verbs_multi_post.c (routing of writes) ->
 * verbs_multi_mr.c (regions, grants, keys) -> verbs_mr.c (a NIC's in-flight count at dereg).
 * Only compiled with libibverbs (PDKV_HAVE_VERBS). */
#ifndef PDKV_VERBS_MULTI_H
#define PDKV_VERBS_MULTI_H

#include "verbs_internal.h"

#define VM_MAX_NICS PDKV_MAX_NICS /* 16; 6 key bits would allow 64; 16 is what a host has */
#define VM_MAX_REGIONS 1023     /* 10 key bits for the index + 1 */
#define VM_MAX_CONNS 256
#define VM_INFO_MAGIC 0x6d6b6470u /* "pdkm" */
#define VM_INFO_VERSION 2 /* 2: the header says which pairs were prepared */

#define VM_KEY(idx, nic, low48) ((uint64_t)((idx) + 1) << 54 | (uint64_t)(nic) << 48 | ((low48) & 0xffffffffffffull))
#define VM_KEY_INDEX(key) ((uint32_t)((key) >> 54))       /* index + 1, 0: none */
#define VM_KEY_NIC(key) ((uint32_t)(((key) >> 48) & 0x3f))
#define VM_KEY_LOW(key) ((key) & 0xffffffffffffull)       /* page offset | rkey */

/* A region's MR on each NIC. Deregistration is all-or-retry: the NICs whose MR went are taken
 * out of `live` one by one; while any is left (a NIC said EBUSY) the region is `dying` -- no
 * new write, grant or key names it -- and the next dereg retries just those NICs. */
typedef struct vm_region {
    int used, dying;
    uint32_t live;                   /* bit n: the MR on NIC n is still registered */
    uint64_t len;
    uint64_t child_key[VM_MAX_NICS]; /* the region's key in each NIC's transport (kept when gone) */
} vm_region;

typedef struct vm_conn {
    int used, ready;
    uint64_t peer;
    uint32_t num_remote;               /* remote NICs this connection has pairs toward */
    uint32_t cid[VM_MAX_NICS][VM_MAX_NICS]; /* [local NIC][remote NIC]: that NIC's connection */
    uint8_t have[VM_MAX_NICS][VM_MAX_NICS]; /* 1: prepared, 2: connected */
} vm_conn;

/* Per NIC, for stats() and /metrics: what this node's writes carried and what landed here. */
typedef struct vm_nic_count {
    uint64_t writes, bytes;           /* accepted for posting through this NIC */
    uint64_t writes_done, bytes_done; /* completed locally */
    uint64_t errors;                  /* writes that failed */
    uint64_t imms, imm_bytes;         /* remote writes with an immediate that landed on this NIC */
} vm_nic_count;

typedef struct vm_transport {
    pdkv_transport base;
    pthread_mutex_t mu;           /* regions, conns, counts, the error queue */
    uint32_t num_nics, num_remote_default; /* pairs prepared toward this many peer NICs */
    uint32_t qps_per_peer;        /* QPs of one pair's connection (the single-NIC transport's) */
    pdkv_transport *nic[VM_MAX_NICS];
    char names[VM_MAX_NICS][64];
    vm_nic_count count[VM_MAX_NICS];
    vm_region *regions;           /* [VM_MAX_REGIONS] */
    vm_conn *conns;               /* [VM_MAX_CONNS] */
    pdkv_completion *errq;        /* writes refused by a NIC after others of their post were taken */
    uint32_t errq_head, errq_count, errq_cap;
    uint32_t next_nic_poll;       /* poll() starts at a different NIC each call (fairness) */
    int efd;                      /* shared by every NIC's progress thread */
} vm_transport;

/* verbs_multi_mr.c: regions and grants (each takes t->mu) */
int vm_reg(pdkv_transport *t, void *addr, uint64_t len, uint64_t *key_out);
int vm_reg_device(pdkv_transport *t, int fd, uint64_t offset, uint64_t len, void *addr,
                  uint64_t *key_out, uint32_t *method_out); /* GPU memory on every NIC */
int vm_grant(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t *key_out);
int vm_revoke(pdkv_transport *t, uint64_t key, uint64_t peer);
int vm_grant_range(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                   uint64_t *key_out);
int vm_revoke_range(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len);
int vm_dereg(pdkv_transport *t, uint64_t key);
int vm_nic_key(pdkv_transport *t, uint64_t key, uint32_t nic, uint64_t *key_out);
/* caller holds t->mu: the region of key (NULL + vm error if unknown) */
vm_region *vm_find_region(vm_transport *t, uint64_t key);
void vm_errq_push(vm_transport *t, const pdkv_completion *c); /* caller holds t->mu */

/* verbs_multi_conn.c: connections; verbs_multi_post.c: writes */
int vm_prepare(pdkv_transport *t, uint64_t peer, void *info_out, uint32_t *info_len,
               uint32_t *conn_out);
int vm_prepare_pairs(pdkv_transport *t, uint64_t peer, const uint8_t *pairs, void *info_out,
                     uint32_t *info_len, uint32_t *conn_out);
uint64_t vm_num_qps(vm_transport *t, uint32_t nic); /* caller holds t->mu */
int vm_complete(pdkv_transport *t, uint32_t conn, const void *info, uint32_t info_len);
int vm_disconnect(pdkv_transport *t, uint32_t conn);
int vm_post(pdkv_transport *t, uint32_t conn, const pdkv_write *w, int n);

/* verbs.c: a single-NIC transport that rings `shared_efd` (not closed by its destroy) */
pdkv_transport *vb_create_shared(uint64_t node_id, const pdkv_verbs_opts *o, int shared_efd,
                                 char *err, size_t errlen);

#endif
