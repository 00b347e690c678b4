/* Same-host shared-memory transport (shm.c): internals shared by its files.
 *
 * A region that peers write into is memory of a shared file (shm_share.c moves a private
 * anonymous region onto an unnamed file in opts->dir in place at reg(); a region that is
 * already a shared mapping is reopened). A grant sends the writer that file's descriptor
 * (SCM_RIGHTS) with the granted range; the writer maps only that range, page-rounded, and
 * acknowledges; revoke unmaps it there before it returns. A write is one memcpy into the
 * writer's mapping, then one message to the owner carrying the immediates of the batch: the
 * owner pushes them as PDKV_CQ_IMM like every other transport.
 */
#ifndef PDKV_SHM_INTERNAL_H
#define PDKV_SHM_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "cq.h"
#include "regions.h"
#include "transport.h"

#define SHM_MAX_CONNS 256
#define SHM_MAX_FDS 512 /* regions with a file, each transport */
#define SHM_TOKEN_MAX 32
#define SHM_REPLY_MS 10000 /* a peer that does not answer a grant or revoke in this is dropped */

enum shm_msg_type { SHM_HELLO = 1, SHM_MAP, SHM_UNMAP, SHM_UNMAP_KEY, SHM_IMM, SHM_REFUSED, SHM_ACK };

typedef struct shm_hdr {
    uint32_t type, n;  /* n: HELLO token bytes, IMM entries, ACK status (int32), else payload bytes */
    uint64_t key, off, len, file_off, node_id;
} shm_hdr;

typedef struct shm_imm { uint32_t imm, pad; uint64_t len; } shm_imm;

#define SHM_MAX_SEGS 8
typedef struct shm_map {
    uint64_t key, off, len; /* the granted range, in the region's offsets */
    uint8_t *base;          /* the page-rounded mapping */
    uint64_t base_len;
    uint8_t *at;            /* where region offset `off` is mapped */
    uint32_t num_cuts;      /* where one file's piece ends and the next begins, from base */
    uint64_t cuts[SHM_MAX_SEGS];
} shm_map;

/* Local pages that are a granted range's memory (share_pages): [local, local+len) is the peer's
 * [roff, roff+len) of rkey, through the grant (mkey, moff, mlen) it was made from. */
typedef struct shm_alias {
    uint64_t lkey, loff, len, rkey, roff;
    uint64_t mkey, moff, mlen;
    uint8_t *local;
} shm_alias;

typedef struct shm_conn {
    uint64_t peer;
    int state;              /* 0 free, 1 prepared, 2 connected, 3 dead */
    int out_fd, in_fd;      /* ours to the peer's listener (our requests); the peer's, accepted */
    pthread_mutex_t out_mu; /* one request (and its reply) at a time on out_fd */
    pthread_mutex_t map_mu; /* maps: a memcpy and an unmap never overlap */
    shm_map *maps;
    uint32_t num_maps, cap_maps;
    uint8_t token[SHM_TOKEN_MAX];
    uint32_t token_len;
    uint64_t writes, bytes;
    shm_alias *aliases;     /* under map_mu, like maps */
    uint32_t num_aliases, cap_aliases;
    struct shm_t *owner;
} shm_conn;

/* A region's page-rounded memory as runs of shared files (one, unless a neighbour registered
 * earlier already moved an edge page onto its own file): [va0, va1) is file fd from foff. */
typedef struct shm_seg { uint64_t va0, va1, foff; int fd; } shm_seg;
/* source: registered as a write source only (reg_source): no files (nseg 0), its own memory as it
 * was, [addr, addr+len); never granted, and its pages go back to fresh anonymous ones on unshare. */
typedef struct shm_file {
    uint64_t key, addr, len;
    uint32_t nseg;
    int source;
    shm_seg seg[SHM_MAX_SEGS];
} shm_file;
typedef struct shm_piece { uint64_t at, len, foff; } shm_piece; /* MAP payload, one per fd */

typedef struct shm_t {
    pdkv_transport base;
    char dir[256];
    char name[108];         /* abstract socket name (name[0] == 0) */
    char host[80];          /* boot id: a peer naming another is not on this host */
    int listen_fd, wake_fd;
    pthread_t thread;
    int running;
    pdkv_regions regions;
    pdkv_cq cq;
    pthread_mutex_t mu;     /* conns[] states, files[] */
    shm_conn conns[SHM_MAX_CONNS];
    uint32_t num_conns;
    shm_file files[SHM_MAX_FDS];
    uint32_t num_files;
    uint64_t refused_writes, refused_conns;
    uint64_t copied_writes, copied_bytes, shared_writes; /* atomics */
    uint32_t fault_fail_maps; /* fault injection: grants still to fail mapping (pdkv_shm_opts) */
    uint32_t lazy_alloc;      /* pdkv_shm_opts.lazy_alloc */
} shm_t;

/* Make [addr, addr+len) (page-rounded) memory of shared files: f->seg (fds owned by the caller).
 * Private anonymous memory is moved onto a new unnamed file in `dir` in place (its bytes kept;
 * `dir`'s free space checked first; allocated whole unless `lazy`); shared mappings are reopened. */
int pdkv_shm_share(const char *dir, int lazy, void *addr, uint64_t len, shm_file *f, char *why, size_t n);
/* This host's identity (the kernel's boot id) into out. */
void pdkv_shm_host_id(char *out, size_t n);
uint64_t pdkv_shm_page(void);

/* shm_alias.c: local pages made the memory of granted ones, and back; c->map_mu held. */
int pdkv_shm_alias(shm_conn *c, const shm_map *m, uint64_t lkey, uint64_t loff, uint64_t rkey, uint64_t roff,
                   uint64_t len, char *why, size_t n);
/* Every alias made through map m (NULL: every alias of c) gets its local memory back. */
void pdkv_shm_unalias_map(shm_conn *c, const shm_map *m);
/* The aliases inside [loff, loff+len) of lkey get their local memory back; how many. */
int pdkv_shm_unalias(shm_conn *c, uint64_t lkey, uint64_t loff, uint64_t len);
/* 1 if write w's source is already its destination (both inside one alias). */
int pdkv_shm_is_shared(const shm_conn *c, const pdkv_write *w);

#endif
