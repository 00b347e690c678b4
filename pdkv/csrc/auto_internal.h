/* auto transport internals (see auto.h): the state and what its files call in each other.
 * Files: auto.c (ops table, completions, relay, counts) -> auto_conn.c (links, writes) ->
 * auto_mem.c (regions, grants, lookups, errors; the leaf). */
#ifndef PDKV_AUTO_INTERNAL_H
#define PDKV_AUTO_INTERNAL_H

#include <pthread.h>

#include "auto.h"
#include "cq.h"

#define AUTO_INFO_MAGIC 0x4f545541u /* "AUTO" */
#define SHM_TAG (1ull << 63)         /* regions.c keys never set it */
#define AUTO_MAX_REGIONS 1024
#define AUTO_MAX_HINTS 256
#define POST_STACK 64

enum { VIA_NONE = 0, VIA_TCP = 1, VIA_SHM = 2 };

typedef struct auto_info { uint32_t magic, tcp_len, shm_len, pad; } auto_info;
/* key: tcp's (ours); skey 0: tcp only; source: registered as a write source only (never granted) */
typedef struct auto_region { uint64_t key, skey; int source; } auto_region;
typedef struct auto_conn {
    uint64_t peer;
    uint32_t tconn, sconn; /* 0: none */
    int via;               /* VIA_NONE until complete() */
    int closed;            /* disconnected: carries nothing now */
    char why[PDKV_REASON_MAX];
} auto_conn;
typedef struct auto_route_stats {
    uint64_t writes, bytes, writes_done, bytes_done, errors, imms, imm_bytes;
} auto_route_stats;

typedef struct auto_t {
    pdkv_transport base;
    pdkv_transport *tcp, *shm;
    pthread_mutex_t mu; /* regions, conns, hints, stats */
    auto_region regions[AUTO_MAX_REGIONS];
    uint32_t num_regions;
    auto_conn **conns; /* grows as links come (each stays where it is: pointers are kept) */
    uint32_t num_conns;
    struct { uint64_t peer; int yes; } hints[AUTO_MAX_HINTS];
    uint32_t num_hints;
    auto_route_stats via[3];
    char reg_note[PDKV_REASON_MAX]; /* the first region shm could not share */
    int efd, stop_fd;               /* ours (the core waits on it), and the relay's stop */
    pdkv_cq notes;                  /* our own completions: a link's grants falling back to tcp */
    int notes_ok;
    pthread_t relay;
    int relay_running;
    uint32_t poll_turn;
} auto_t;

extern __thread char pdkv_auto_err[PDKV_ERR_MAX];
int pdkv_auto_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int pdkv_auto_sub_fail(pdkv_transport *s, int rc); /* a sub-transport's failure, its message kept */
uint64_t pdkv_auto_skey(auto_t *t, uint64_t key);   /* shm's key of region key, 0: tcp only */
auto_conn *pdkv_auto_conn(auto_t *t, uint32_t id);

int pdkv_auto_reg(pdkv_transport *bt, void *addr, uint64_t len, uint64_t *key);
int pdkv_auto_reg_source(pdkv_transport *bt, void *addr, uint64_t len, uint64_t *key);
int pdkv_auto_dereg(pdkv_transport *bt, uint64_t key);
int pdkv_auto_grant(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t *out);
int pdkv_auto_revoke(pdkv_transport *bt, uint64_t k, uint64_t p);
int pdkv_auto_grant_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len, uint64_t *out);
int pdkv_auto_revoke_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len);

int pdkv_auto_same_host(pdkv_transport *bt, uint64_t peer, int yes);
int pdkv_auto_prepare(pdkv_transport *bt, uint64_t peer, void *info, uint32_t *len, uint32_t *conn);
int pdkv_auto_set_token(pdkv_transport *bt, uint32_t id, const void *tok, uint32_t len);
int pdkv_auto_complete(pdkv_transport *bt, uint32_t id, const void *info, uint32_t len);
int pdkv_auto_disconnect(pdkv_transport *bt, uint32_t id);
const char *pdkv_auto_route(pdkv_transport *bt, uint32_t id, char *why, size_t n);
int pdkv_auto_post(pdkv_transport *bt, uint32_t id, const pdkv_write *w, int n);

#endif
