/* Internal state of the libfabric transport (fabric*.c; the call order is below).
 * Only compiled when the libfabric headers are present (PDKV_HAVE_LIBFABRIC). */
#ifndef PDKV_FABRIC_INTERNAL_H
#define PDKV_FABRIC_INTERNAL_H

#include "cq.h"
#include "transport.h"

#include <pthread.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define FB_MAX_CONNS 1024
#define FB_MAX_REGIONS 1023   /* registered regions (10 bits of the key hold the index + 1) */
#define FB_MAX_DOMAINS 1024   /* (peer, device) pairs with a domain of their own */
#define FB_MAX_DEVS PDKV_MAX_NICS /* devices (EFA NICs, interfaces) of one transport: 4 key bits */
#define FB_MAX_LINKS 256      /* connections the core sees (each one endpoint per device pair) */
#define FB_MAX_GRANTS 65536   /* live grants of one peer domain */
#define FB_TX_DEPTH 1024      /* writes outstanding on one endpoint (capped by tx_attr->size) */
#define FB_ADDR_MAX 256       /* an endpoint name (fi_getname) */
#define FB_INFO_MAGIC 0x62666b70u /* "pkfb" */
#define FB_INFO_VERSION 2 /* 2: one endpoint name per (local device, remote device) pair */
#define FB_IMM_BYTES 4        /* the remote CQ data pdkv's immediates need */
#define FB_STALL_MS 5000      /* writes waiting with no progress this long: the peer is gone
                               * (providers may never fail them), the connection breaks */

/* Keys are libfabric MR keys we choose (requested_key), and a write key says where to aim:
 *   [63] narrow | [62:59] device | [58:48] tag | [47:0] base
 * The writer aims at base + roff when the target's MRs take virtual addresses (FI_MR_VIRT_ADDR:
 * base = the region's address), else at roff - base (offsets into the MR: base = where the MR
 * starts in its region). 48 bits hold any user-space address of x86-64 and aarch64.
 * A region's own key (what reg() returns) has tag = index + 1 and the base of the whole region;
 * its key on device d (nic_key) has d in the device bits. A whole-region grant is an MR under
 * exactly that key in the peer's domain on that device, so the key is what the peer writes with
 * (as on tcp), and its device bits say which of the target's devices the write must reach. A
 * narrow grant's MR gets bit 63, the device and a random 11-bit tag (unique with its base among
 * the domain's live MRs: not secret, only another name; another peer's domain has none of
 * them). Local-only MRs have tag 0 (FB_LKEY): no wire key does. */
#define FB_WKEY(tag, base) ((uint64_t)(tag) << 48 | ((base) & 0xffffffffffffull))
#define FB_WKEY_BASE(key) ((key) & 0xffffffffffffull)
#define FB_NARROW (1u << 15)
#define FB_TAG_BITS 0x7ffu
#define FB_DEV_SHIFT 59
#define FB_DEV_MASK (0xfull << FB_DEV_SHIFT)
#define FB_KEY_DEV(key) ((uint32_t)((key) >> FB_DEV_SHIFT) & 0xf)
#define FB_ON_DEV(key, dev) (((key) & ~FB_DEV_MASK) | (uint64_t)(dev) << FB_DEV_SHIFT)
#define FB_RKEY(idx, base) FB_WKEY((idx) + 1, base)
#define FB_RKEY_INDEX(key) ((uint32_t)((key) >> 48) & 0x3ff) /* index + 1, 0: none */
#define FB_LKEY(idx) (1ull << 62 | (uint64_t)(idx)) /* a region's local MR in a peer domain */
#define FB_INFO_VIRT 1u       /* info flag: the sender's MRs take virtual addresses */
#define FB_INFO_TABLE 2u      /* ... its keys are provider keys: aim through its region table */

/* Provider keys (FI_MR_PROV_KEY, e.g. EFA: 32-bit keys of the device's MRs): the provider picks
 * each MR's key, so a key cannot carry the base. A grant's key is then
 *   [63:32] the provider's key | [19:16] device | [15] 1 | [9:0] region index + 1
 * and the writer aims at the region's address (from the target's region table, sent in its
 * connection info: the regions registered before it prepared the connection) + roff. A region
 * registered later is not in a connection's table: a write into it fails, naming that. */
#define FB_TABLE_FLAG (1u << 15)
#define FB_TKEY(pkey, idx, dev) ((uint64_t)(pkey) << 32 | (uint64_t)(dev) << 16 | FB_TABLE_FLAG | \
                                 ((idx) + 1))
#define FB_TKEY_DEV(key) ((uint32_t)((key) >> 16) & 0xf)

typedef struct fb_region {
    uint8_t *addr;
    uint64_t key, len; /* key 0: free slot */
    uint32_t inflight; /* local writes from this region not yet completed */
    /* device memory (reg_device): every MR of the region (local, grants) is registered with
     * fi_mr_regattr naming it; iface FI_HMEM_SYSTEM and dmabuf_fd < 0: plain host memory */
    int iface;         /* enum fi_hmem_iface */
    uint64_t device;   /* the iface's device (CUDA: the ordinal) */
    int dmabuf_fd;     /* our dup of the dma-buf (FI_MR_DMABUF), or -1 */
    uint64_t dmabuf_off; /* where the region starts in it */
} fb_region;

/* A grant's MR on one endpoint (FI_MR_ENDPOINT): conn is the endpoint's index in t->conns. */
typedef struct fb_ep_mr {
    uint32_t conn;
    struct fid_mr *mr;
} fb_ep_mr;

/* A registration of (part of) a region that one peer may write: the grant itself (the provider
 * checks key, access and bounds). off/len are region offsets; whole: the entire region.
 * mr: the domain's MR; under FI_MR_ENDPOINT NULL, and on_ep holds one MR per endpoint of the
 * domain, all under wkey (fabric_mrep.c). */
typedef struct fb_grant_mr {
    struct fid_mr *mr;
    uint32_t region;
    int whole;
    uint64_t off, len, wkey;
    fb_ep_mr *on_ep;
    uint32_t num_on_ep, on_ep_cap;
} fb_grant_mr;

/* One fabric domain per peer and device (libfabric MR keys are domain-wide, so a peer's domain
 * holds only its grants and our local registrations: another peer's key opens nothing in it). */
typedef struct fb_domain {
    int used;
    uint32_t dev;        /* the device (t->dev[]) it was opened on */
    uint64_t peer;
    struct fid_domain *dom;
    struct fid_mr **lmr; /* [FB_MAX_REGIONS] local-only MRs (sources of our writes), by index;
                          * unused under FI_MR_ENDPOINT (each endpoint has its own: fb_conn) */
    fb_grant_mr *grants;
    uint32_t num_grants, grants_cap;
    uint32_t num_conns;
    uint64_t tag_seed;   /* tags are drawn from a sequence that starts here (random) */
} fb_domain;

/* A posted write: its context (the provider hands it back with the completion). */
typedef struct fb_pending {
    struct fi_context2 ctx; /* first: FI_CONTEXT / FI_CONTEXT2 providers own these bytes */
    uint64_t wr_id, len;
    uint32_t region;
    int used;
} fb_pending;

/* One endpoint pair of a connection: from local device `dev` to the peer's device `rdev`. The
 * core's connection is an fb_link of these (fabric_link.c); the progress thread drives these. */
typedef struct fb_conn {
    int used, ready, broken;
    uint64_t peer;
    uint32_t dev, rdev, link;
    uint32_t domain;       /* index into t->domains (the peer's domain on `dev`) */
    struct fid_ep *ep;     /* an endpoint of its own: closing it ends everything of the conn */
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_mr **lmr;   /* FI_MR_ENDPOINT: [FB_MAX_REGIONS] local MRs bound to ep, else NULL */
    fi_addr_t dest;
    int peer_virt;         /* the peer's MRs take virtual addresses (its info's flag) */
    uint64_t *peer_table;  /* the peer's provider keys: its regions' addresses by index, or NULL */
    uint32_t peer_table_n;
    fb_pending *slots;     /* [t->tx_depth] */
    uint32_t outstanding;
    uint32_t next_slot;    /* search start for a free slot */
    uint64_t last_ns;      /* when its writes last made progress (accepted while idle, handed
                            * to the provider, or completed): the stall clock */
    pdkv_write *backlog;   /* accepted writes not yet handed to the provider (ring) */
    uint32_t bl_head, bl_count, bl_cap;
    uint32_t post_need;    /* fb_post's count of its writes for this pair (0 between posts) */
} fb_conn;

/* A connection as the core sees it: the endpoint pairs (local device i, remote device j) its
 * writes can use (all of this transport's, or those prepare_pairs named), cid[i][j] = the
 * fb_conn's index + 1 (0: none). A write goes on the pair of its local key's device and its
 * remote key's device. */
typedef struct fb_link {
    int used, ready;
    uint64_t peer;
    int peer_table;        /* the peer's keys are provider keys (device bits at FB_TKEY_DEV) */
    uint16_t cid[FB_MAX_DEVS][FB_MAX_DEVS];
} fb_link;

/* Connection data exchanged through the messenger's control channel: this header, then
 * num_pairs fb_info_pair (each with its endpoint's name), then FB_INFO_TABLE's num_regions
 * uint64 region addresses. */
typedef struct fb_info {
    uint32_t magic, version;
    uint64_t node_id;
    uint32_t flags;        /* FB_INFO_VIRT | FB_INFO_TABLE */
    uint32_t num_devs;     /* the sender's devices */
    char provider[32];     /* both ends must run the same provider */
    uint32_t num_pairs;
    uint32_t num_regions;
} fb_info;

typedef struct fb_info_pair {
    uint8_t dev, rdev;     /* the sender's device, the device of ours it pairs with */
    uint16_t addr_len;
    uint8_t addr[FB_ADDR_MAX];
} fb_info_pair;

/* One opened device: its fi_info (the provider's domain), fabric and counts. */
typedef struct fb_dev {
    struct fi_info *info;
    struct fid_fabric *fabric;
    char name[64];         /* the domain name (and "@fabric" when named so) */
    pdkv_nic_stats nic;    /* what it carried (an EFA device, an interface), nic_stats() */
} fb_dev;

typedef struct fb_transport {
    pdkv_transport base;
    pthread_mutex_t mu;    /* every libfabric call and all state below (FI_THREAD_DOMAIN) */
    struct fi_info *info;  /* device 0's: what every device has alike (mode, sizes) */
    fb_dev dev[FB_MAX_DEVS];
    uint32_t num_devs;
    char provider[32];
    int virt;              /* FI_MR_VIRT_ADDR: remote addresses are virtual addresses */
    int table;             /* provider keys (FI_MR_PROV_KEY, or the table_keys stand-in) */
    int prov_key;          /* ... chosen by the provider (not the stand-in) */
    int mr_local;          /* FI_MR_LOCAL: descriptors on every write */
    int mr_ep;             /* FI_MR_ENDPOINT: every MR bound to an endpoint (fabric_mrep.c) */
    int hmem;              /* the provider registers device memory (FI_HMEM, FI_MR_HMEM) */
    int hmem_asked;        /* the options asked for it (device_memory) */
    int hmem_system;       /* the stand-in: reg_device takes host memory through FI_HMEM_SYSTEM */
    uint64_t complete_flag; /* FI_DELIVERY_COMPLETE, or 0 (shm: FI_TRANSMIT_COMPLETE) */
    int batch_more;        /* FI_MORE on all but the last write of a burst (fabric_post.c) */
    uint32_t tx_depth;
    fb_region *regions;
    uint32_t num_regions;
    fb_domain *domains;    /* [FB_MAX_DOMAINS] */
    fb_link *links;        /* [FB_MAX_LINKS] */
    fb_conn *conns;
    uint32_t conns_hi;     /* conns[conns_hi..] have never been used: loops stop there */
    pdkv_cq cq;            /* completions for the core, behind its eventfd */
    int cq_ready;
    pthread_t thread;
    int thread_started, stop;
    uint64_t refused_writes;
} fb_transport;

/* Call order (each file calls only files below it):
 *   fabric.c (function table, create, destroy) -> fabric_progress.c (the progress thread)
 *   -> fabric_link.c (connections: their endpoint pairs, routing of writes)
 *   -> fabric_conn.c (endpoints) -> fabric_post.c (backlog, posting) -> fabric_mr.c (regions,
 *   grants, domains) -> fabric_mrep.c (MRs bound to endpoints) -> fabric_keys.c (grant keys)
 *   -> fabric_setup.c (provider choice, fabric, per-peer objects)
 *   -> fabric_dl.c (libfabric loaded at run time) -> fabric_report.c (errors, completions). */

/* fabric_dl.c (leaf): libfabric's entry points, loaded at the first create (never linked) */
int fbl_load(void); /* 0, or -ENODEV + fb_fail naming why */
int fbl_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                const struct fi_info *hints, struct fi_info **info);
void fbl_freeinfo(struct fi_info *info);
struct fi_info *fbl_dupinfo(const struct fi_info *info);
int fbl_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
const char *fbl_strerror(int errnum);

/* fabric_report.c */
uint64_t fb_now_ns(void);
int fb_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *fb_errbuf(void); /* this thread's last failure reason */
void fb_clear_error(void);
void fb_push_error(fb_transport *t, uint64_t wr_id, uint64_t peer, int status, const char *fmt,
                   ...) __attribute__((format(printf, 5, 6)));
int fb_errno(int fi_rc); /* a libfabric return code as a negative errno */
/* *items (*cap entries of `size` bytes) twice as long, or `first` long; 0 or -ENOMEM */
int fb_grow(void **items, uint32_t *cap, size_t size, uint32_t first);

/* fabric_setup.c */
int fb_open_fabric(fb_transport *t, const pdkv_libfabric_opts *o);
int fb_open_domain(fb_transport *t, uint32_t dev, struct fid_domain **out);
int fb_open_endpoint(fb_transport *t, struct fid_domain *dom, fb_conn *c);
void fb_close_endpoint(fb_conn *c);
/* An MR over [off, off+len) of region r (device memory through fi_mr_regattr, see fb_region) */
int fb_mr_reg(fb_transport *t, struct fid_domain *dom, const fb_region *r, uint64_t off,
              uint64_t len, uint64_t access, uint64_t key, struct fid_mr **out);
/* FI_MR_ENDPOINT: fi_mr_bind(mr, ep) then fi_mr_enable; on failure mr is closed (*mr = NULL) */
int fb_mr_bind_ep(fb_transport *t, struct fid_mr **mr, struct fid_ep *ep);

/* fabric_mr.c: regions, per-peer domains, grants (caller holds t->mu unless named a vtable op) */
int fb_reg(pdkv_transport *t, void *addr, uint64_t len, uint64_t *key_out);
int fb_reg_device(pdkv_transport *t, int fd, uint64_t offset, uint64_t len, void *addr,
                  uint64_t *key_out, uint32_t *method_out);
int fb_grant(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t *key_out);
int fb_revoke(pdkv_transport *t, uint64_t key, uint64_t peer);
int fb_grant_range(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                   uint64_t *key_out);
int fb_revoke_range(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len);
int fb_dereg(pdkv_transport *t, uint64_t key);
fb_region *fb_find_region(fb_transport *t, uint64_t key);
fb_domain *fb_domain_get(fb_transport *t, uint64_t peer, uint32_t dev, int create); /* + fb_fail */
void fb_domain_tidy(fb_transport *t, fb_domain *d); /* free it once no conn or grant uses it */
void fb_domain_free(fb_transport *t, fb_domain *d);

/* fabric_mrep.c: FI_MR_ENDPOINT, an MR per endpoint (caller holds t->mu; only when t->mr_ep) */
int fb_ep_open_mrs(fb_transport *t, uint32_t ci); /* a new endpoint: every region's, grant's */
void fb_ep_close_mrs(fb_transport *t, uint32_t ci); /* its endpoint is closed: drop its MRs */
int fb_ep_grant(fb_transport *t, fb_domain *d, fb_grant_mr *g); /* a new grant on d's endpoints */
void fb_ep_grant_close(fb_grant_mr *g);
int fb_ep_region(fb_transport *t, uint32_t idx); /* a new region's local MR on every endpoint */
void fb_ep_region_close(fb_transport *t, uint32_t idx);

/* fabric_keys.c: grant keys (caller holds t->mu) */
int fb_narrow_key(fb_domain *d, uint64_t base, uint64_t *out); /* our requested keys */
int fb_table_grant(fb_transport *t, fb_domain *d, uint32_t region, uint64_t off, uint64_t len,
                   struct fid_mr **mr, uint64_t *wkey); /* provider keys: register, then name */
int fb_nic_key(pdkv_transport *t, uint64_t key, uint32_t dev, uint64_t *key_out);

/* fabric_post.c */
int fb_check_writes(fb_transport *t, const pdkv_write *w, int n);
int fb_reserve(fb_conn *c, uint32_t need); /* room for `need` more in the backlog, or -ENOMEM */
void fb_enqueue(fb_transport *t, fb_conn *c, const pdkv_write *w, int n); /* checked, reserved */
int fb_pump(fb_transport *t, fb_conn *c); /* hand backlog to the provider; returns how many */
void fb_flush_backlog(fb_transport *t, fb_conn *c, int status, const char *why);
void fb_fail_outstanding(fb_transport *t, fb_conn *c, int status, const char *why);

/* fabric_conn.c: one endpoint pair (caller holds t->mu) */
int fb_conn_open(fb_transport *t, uint64_t peer, uint32_t dev, uint32_t rdev, uint32_t *ci);
int fb_conn_name(fb_transport *t, fb_conn *c, fb_info_pair *out);
int fb_conn_connect(fb_transport *t, fb_conn *c, const fb_info_pair *peer_ep);
void fb_drop_conn(fb_transport *t, fb_conn *c, const char *why);

/* fabric_link.c: the core's connections */
int fb_prepare(pdkv_transport *t, uint64_t peer, void *info_out, uint32_t *info_len,
               uint32_t *conn_out);
int fb_prepare_pairs(pdkv_transport *t, uint64_t peer, const uint8_t *pairs, void *info_out,
                     uint32_t *info_len, uint32_t *conn_out);
int fb_complete(pdkv_transport *t, uint32_t conn, const void *info, uint32_t info_len);
int fb_disconnect(pdkv_transport *t, uint32_t conn);
int fb_post(pdkv_transport *t, uint32_t conn, const pdkv_write *w, int n);
void fb_drop_link(fb_transport *t, fb_link *l, const char *why);

/* fabric_progress.c */
int fb_start_progress(fb_transport *t);
void fb_stop_progress(fb_transport *t);

#endif
