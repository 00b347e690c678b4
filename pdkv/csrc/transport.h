/* pdkv transport interface: one-sided writes into registered memory, with immediates.
 *
 * Everything above this interface (the counter poller, page-batch planning, immediate counting,
 * completion delivery to Python) is transport-blind. A transport is a vtable plus an opaque state.
 *
 * Connection set-up is two-phase so that verbs (per-connection QP data) and tcp (listener
 * address) fit the same shape; the blobs travel over the messenger's control channel:
 *   A: conn = prepare(peer=B, info_A)      B: conn = prepare(peer=A, info_B)
 *   ... exchange info_A / info_B out of band ...
 *   A: complete(conn, info_B)              B: complete(conn, info_A)
 * After both complete, each side may post writes to the other through its conn.
 *
 * Error convention: functions return 0 (or a count) on success and a negative errno-style code
 * on failure, with a human-readable reason written into the transport's last_error buffer
 * (ops->last_error). Nothing here calls into Python; all functions may be called without the GIL.
 *
 * NOTE: a region may not be deregistered while a write from or into it can still land:
 * dereg returns -EBUSY in that case, never frees under a pending write.
 */
#ifndef PDKV_TRANSPORT_H
#define PDKV_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PDKV_INFO_MAX 65536  /* largest connection-info blob (verbs: one per NIC pair) */
#define PDKV_MAX_NICS 16     /* NICs of one verbs transport (prepare_pairs' row length) */
#define PDKV_REASON_MAX 160  /* longest error reason in a completion */
/* longest error reason of a call (the err buffers of core calls, a transport's last_error): the
 * longest message is verbs_multi_mr.c's region still registered on busy NICs, which names up to
 * PDKV_MAX_NICS NICs of up to 63 bytes each (~1.2 KB) */
#define PDKV_ERR_MAX 1280

enum pdkv_cq_kind {
    PDKV_CQ_WRITE_DONE = 1, /* a local write (wr_id) completed: the source may be reused */
    PDKV_CQ_IMM = 2,        /* a remote write carrying imm landed in our memory */
    PDKV_CQ_ERROR = 3,      /* wr_id (or 0) / peer failed: reason says why */
};

typedef struct pdkv_completion {
    uint32_t kind;     /* enum pdkv_cq_kind */
    uint32_t imm;      /* PDKV_CQ_IMM: the immediate value */
    uint64_t wr_id;    /* PDKV_CQ_WRITE_DONE / ERROR: the caller's id of the write (0 if none) */
    uint64_t peer;     /* node id of the peer the completion concerns */
    uint64_t len;      /* bytes written (WRITE_DONE) or landed (IMM) */
    int32_t status;    /* 0, or a negative errno-style code for ERROR */
    char reason[PDKV_REASON_MAX];
} pdkv_completion;

/* One write of a batch: local region+offset -> remote key+offset. */
typedef struct pdkv_write {
    uint64_t lkey, loff;
    uint64_t rkey, roff;
    uint64_t len;
    uint64_t wr_id;
    uint32_t imm;
    uint32_t has_imm;
} pdkv_write;

typedef struct pdkv_transport pdkv_transport;

/* reg_device's way: a dma-buf, peer memory (verbs: nvidia-peermem), or libfabric FI_HMEM with the
 * device pointer */
enum pdkv_reg_method { PDKV_REG_DMABUF = 1, PDKV_REG_PEERMEM = 2, PDKV_REG_HMEM = 3 };

/* What one NIC carried (verbs over several NICs; stats() and /metrics). */
typedef struct pdkv_nic_stats {
    char name[64];
    uint64_t writes, bytes;           /* writes accepted for posting through this NIC */
    uint64_t writes_done, bytes_done; /* ... completed locally */
    uint64_t errors;                  /* ... failed */
    uint64_t imms, imm_bytes;         /* remote writes carrying an immediate that landed on it */
    uint64_t qps;                     /* queue pairs on it now, every connection's */
} pdkv_nic_stats;

typedef struct pdkv_transport_counters {
    uint64_t refused_writes; /* remote writes refused before landing (key, grant, range, bounds) */
    uint64_t refused_conns;  /* incoming connections closed: bad hello/token, deadline, cap */
    uint64_t pending_conns;  /* incoming connections not yet authenticated, now */
    uint64_t rx_threads;     /* receive threads running now */
    uint64_t copied_writes, copied_bytes; /* shm: writes that were a memcpy, and their bytes */
    uint64_t shared_writes;  /* shm: writes whose source already is their destination (no copy) */
} pdkv_transport_counters;

typedef struct pdkv_transport_ops {
    const char *name; /* "tcp", "verbs", "libfabric", "fake" */

    /* Register [addr, addr+len). *key_out is what a peer names in its writes. */
    int (*reg)(pdkv_transport *t, void *addr, uint64_t len, uint64_t *key_out);
    /* Grants: a peer may write into a region only while it holds a grant to it. tcp and fake
     * check every frame against the writer's grants before a byte lands; verbs has the NIC check
     * them (a protection domain per peer, see verbs_mr.c). *key_out (may be NULL) gets the key
     * that peer must name in its writes: `key` itself on tcp/fake, a per-peer key on verbs.
     * grant: the whole region. revoke: end it (-ENOENT if not held; tcp/fake: -EBUSY while a
     * write it allowed is landing). Once revoke returns 0, nothing from that peer lands there. */
    int (*grant)(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t *key_out);
    int (*revoke)(pdkv_transport *t, uint64_t key, uint64_t peer);
    /* Narrow grants: only [off, off+len) of the region (in the region's own offsets, the same
     * offsets writes use). A peer's ranges in one region must not overlap (-EEXIST); a write must
     * lie inside one range. revoke_range names exactly a granted range (-ENOENT otherwise). */
    int (*grant_range)(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                       uint64_t *key_out);
    int (*revoke_range)(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len);
    /* -EBUSY while writes from or into the region are in flight; -ENOENT for an unknown key. */
    int (*dereg)(pdkv_transport *t, uint64_t key);

    /* Two-phase connect (see above). info_out has room for PDKV_INFO_MAX bytes. */
    int (*prepare)(pdkv_transport *t, uint64_t peer, void *info_out, uint32_t *info_len,
                   uint32_t *conn_out);
    int (*complete)(pdkv_transport *t, uint32_t conn, const void *info, uint32_t info_len);
    /* Optional (NULL: the transport needs none; verbs binds QPs through the info exchange).
     * tcp: bind conn to a token (16..32 bytes) both nodes got from their authenticated control
     * session, before complete() and before the info is sent: the peer's streams must present
     * it in their first frame or are closed unread; it is never put in the info blob. */
    int (*set_token)(pdkv_transport *t, uint32_t conn, const void *token, uint32_t len);
    /* Optional (NULL: not offered). tcp: seal every stream of conn (AES-256-GCM records, keys
     * derived from this 32-byte key both nodes derived from their control session); before
     * complete(). -ENOTSUP when built without libcrypto. */
    int (*set_data_key)(pdkv_transport *t, uint32_t conn, const void *key, uint32_t len);
    /* Drop a connection: pending writes complete with ERROR; nothing is left running for it. */
    int (*disconnect)(pdkv_transport *t, uint32_t conn);

    /* Post n writes to the peer of conn. Returns n, or a negative code if none were posted. */
    int (*post)(pdkv_transport *t, uint32_t conn, const pdkv_write *w, int n);

    /* Non-blocking: fill up to max completions, return how many. */
    int (*poll)(pdkv_transport *t, pdkv_completion *out, int max);
    /* An fd that is readable when poll may return something (eventfd semantics). */
    int (*event_fd)(pdkv_transport *t);

    const char *(*last_error)(pdkv_transport *t);
    /* Counters for stats() and tests (fields a transport does not track stay 0). */
    void (*counters)(pdkv_transport *t, struct pdkv_transport_counters *out);
    /* Stop every thread, close every fd, free everything. Safe with writes in flight. */
    void (*destroy)(pdkv_transport *t);

    /* Optional (NULL on tcp/fake: one path). verbs over several NICs: the key of the region of
     * `key` on NIC `nic` (an index into the transport's NIC list). A write leaves through the NIC
     * of its local key and arrives through the NIC of its remote key. */
    int (*nic_key)(pdkv_transport *t, uint64_t key, uint32_t nic, uint64_t *key_out);
    /* Optional: fill up to max per-NIC counts; returns the number of NICs. */
    int (*nic_stats)(pdkv_transport *t, pdkv_nic_stats *out, int max);
    /* Optional (verbs): register device (GPU) memory for GPUDirect RDMA: first as the dma-buf
     * `fd` at `offset` (fd < 0: skip), then as the device pointer `addr` (peer memory, NULL:
     * skip). *method_out: PDKV_REG_DMABUF or PDKV_REG_PEERMEM. The fd is not taken (the transport
     * keeps a dup). -EOPNOTSUPP with both attempts named when neither works. */
    int (*reg_device)(pdkv_transport *t, int fd, uint64_t offset, uint64_t len, void *addr,
                      uint64_t *key_out, uint32_t *method_out);
    /* Optional (verbs; NULL elsewhere: one path). prepare() with queue pairs for only the (local
     * NIC i, remote NIC j) pairs with pairs[i * PDKV_MAX_NICS + j] set -- the pairs the caller's
     * writes can use -- instead of every pair. complete() connects a pair only if both sides
     * asked for it; a write on a pair that was not made is refused (-EINVAL), naming it. */
    int (*prepare_pairs)(pdkv_transport *t, uint64_t peer, const uint8_t *pairs, void *info_out,
                         uint32_t *info_len, uint32_t *conn_out);
    /* Optional (NULL: a region has one key). 1 if keys a and b name the same region (verbs over
     * several NICs: its key on each NIC), so a batch queued from any of them holds its dereg. */
    int (*same_region)(pdkv_transport *t, uint64_t a, uint64_t b);
    /* Optional (shm; NULL elsewhere: -EOPNOTSUPP). Make [loff, loff+len) of local region `lkey`
     * the very memory of [roff, roff+len) of the peer's region `rkey` granted on `conn` (both
     * page-aligned): what this process computes there lands in the peer, and a write from it to
     * that range moves nothing. share_pages(); unshare_pages() gives the local range its own
     * memory back (also done when the grant is revoked or the connection ends); 0 if not shared. */
    int (*share_pages)(pdkv_transport *t, uint32_t conn, uint64_t lkey, uint64_t loff, uint64_t rkey,
                       uint64_t roff, uint64_t len);
    int (*unshare_pages)(pdkv_transport *t, uint32_t conn, uint64_t lkey, uint64_t loff, uint64_t len);
    /* Optional (auto; NULL elsewhere: one path). Before prepare(): whether the control handshake
     * found `peer` on this host (auto offers it shm only then). */
    int (*same_host)(pdkv_transport *t, uint64_t peer, int yes);
    /* Optional (auto): the name of the transport carrying conn ("shm", "tcp"), why (n bytes) it
     * is not shm ("" when it is). conn 0: NULL, and why names a region that could not be shared. */
    const char *(*route)(pdkv_transport *t, uint32_t conn, char *why, size_t n);
    /* Optional (shm, auto; NULL: reg() serves). Register [addr, addr+len) as a write source only:
     * its memory stays as it is (shm moves nothing onto a shared file, so private anonymous pages
     * stay private and untouched pages stay unallocated); granting it, whole or in part, is
     * refused (-EPERM, naming the key). It may be the local side of share_pages (its whole pages
     * only); unsharing gives those pages fresh zeroed memory, not their contents from before. */
    int (*reg_source)(pdkv_transport *t, void *addr, uint64_t len, uint64_t *key_out);
} pdkv_transport_ops;

struct pdkv_transport {
    const pdkv_transport_ops *ops;
    uint64_t node_id; /* this node's id, sent to peers */
};

/* Constructors. Each returns NULL and writes a reason into err on failure. */
typedef struct pdkv_tcp_opts {
    const char *host;      /* listen address, e.g. "127.0.0.1" */
    uint16_t port;         /* 0: any free port */
    uint32_t num_streams;  /* connections per peer */
    uint32_t handshake_ms; /* an incoming stream must send its hello within this (0: 5000) */
    uint32_t max_pending;  /* incoming streams waiting for their hello at once (0: 64) */
    uint32_t max_per_source; /* ... of them from one IP address (0: a quarter of max_pending) */
} pdkv_tcp_opts;
pdkv_transport *pdkv_tcp_create(uint64_t node_id, const pdkv_tcp_opts *opts, char *err,
                                size_t errlen);

typedef struct pdkv_verbs_opts {
    const char *const *nics; /* device names, NULL-terminated; never "auto" here (Python resolves it) */
    uint8_t port_num;        /* usually 1 */
    int gid_index;           /* -1: pick a RoCE v2 / IB GID automatically */
    uint32_t qps_per_peer;
    int isolate_peers;       /* a protection domain per peer: grants enforced by the NIC */
    uint32_t remote_nics;    /* several NICs: queue-pair pairs toward this many peer NICs (0: as
                              * many as we have) */
} pdkv_verbs_opts;
/* Defined only when built with libibverbs (PDKV_HAVE_VERBS). One NIC (nics[0], nics[1] == NULL). */
pdkv_transport *pdkv_verbs_create(uint64_t node_id, const pdkv_verbs_opts *opts, char *err,
                                  size_t errlen);
/* One transport over every NIC of opts->nics (1..16), see verbs_multi.h: what "verbs" makes. */
pdkv_transport *pdkv_verbs_multi_create(uint64_t node_id, const pdkv_verbs_opts *opts, char *err,
                                        size_t errlen);

typedef struct pdkv_libfabric_opts {
    const char *provider;       /* "efa", "tcp;ofi_rxm", "sockets", "shm"; NULL or "auto": the
                                 * first provider offering RDM endpoints with RMA and CQ data */
    const char *const *domains; /* fabric domain names (EFA: the device, e.g. "rdmap16s27-rdm";
                                 * tcp: the interface), NULL-terminated; NULL/empty: the first */
    int table_keys;             /* the FI_MR_PROV_KEY key path (per-peer keys, the region table in
                                 * the connection info) on a provider that takes requested keys:
                                 * the CPU stand-in for EFA's provider keys (tests) */
    int device_memory;          /* ask the provider for FI_HMEM, so that reg_device can register
                                 * GPU memory (EFA); off: the plain hints (FI_HMEM changes some
                                 * providers' protocols: shm's 64 KiB writes get 10x slower) */
    int hmem_system;            /* reg_device registers through FI_HMEM with iface FI_HMEM_SYSTEM
                                 * (host memory): the CPU stand-in for GPU memory (tests; implies
                                 * device_memory) */
} pdkv_libfabric_opts;
/* Defined only when built with libfabric (PDKV_HAVE_LIBFABRIC), see fabric.c. */
pdkv_transport *pdkv_libfabric_create(uint64_t node_id, const pdkv_libfabric_opts *opts, char *err,
                                      size_t errlen);

/* What a transport can do, declared in its row of the table (transports.c) and read by the layers
 * above (config validation, staging) instead of its name; pdkv/transports.py mirrors the bits. */
enum pdkv_capability {
    PDKV_CAP_HOST_MEMORY = 1,     /* writes from and into registered host memory */
    PDKV_CAP_DEVICE_MEMORY = 2,   /* registers device (GPU) memory itself (reg_device) */
    PDKV_CAP_SAME_HOST_ONLY = 4,  /* both ends must be processes of one host */
    PDKV_CAP_PEER_ISOLATION = 8,  /* grants per peer: a peer writes only what it was granted */
    PDKV_CAP_GPUDIRECT = 16,      /* device memory reached by the NIC's DMA (dma-buf, peer memory) */
    PDKV_CAP_SEALED_STREAMS = 32, /* the data path can be encrypted and authenticated (set_data_key) */
    PDKV_CAP_INSTANT_GRANTS = 64, /* grant/revoke are table entries (no registration, no peer round trip) */
};

/* The transport seam: a table of (name, constructor taking that transport's options struct,
 * capabilities) in transports.c. A transport is added by one row there (and its options struct
 * here); names a build lacks stay in the table with the reason, so asking for them is a clear
 * error. */
typedef pdkv_transport *(*pdkv_transport_ctor)(uint64_t node_id, const void *opts, char *err,
                                               size_t errlen);
/* By name with that transport's options (NULL: its defaults where it has any). NULL with a reason
 * in err for an unknown or unavailable name. */
pdkv_transport *pdkv_transport_open(const char *name, uint64_t node_id, const void *opts, char *err,
                                    size_t errlen);
/* 1 if `name` is in the table and built in. */
int pdkv_transport_available(const char *name);
/* The i-th row's name (NULL past the end): every transport, built in or not, in table order. */
const char *pdkv_transport_name(unsigned i);
/* The capabilities (enum pdkv_capability bits) `name` declares; -1 for a name not in the table. */
int pdkv_transport_caps(const char *name);

/* 1 if this build has the verbs transport (libibverbs headers were found at build time). */
int pdkv_have_verbs(void);
int pdkv_have_crypto(void); /* tcp sealed streams (messenger.tls_data) built in: libcrypto */
/* The port a tcp transport listens on (logs and tests); -1 for any other transport. */
int pdkv_tcp_port(pdkv_transport *t);

#ifdef __cplusplus
}
#endif
#endif /* PDKV_TRANSPORT_H */
