/* Registered-memory table for the user-space transports (tcp, fake).
 *
 * A key names one region; a peer may write into it only while it holds a grant (grants.h):
 * the whole region (grant) or byte ranges of it (grant_range), until revoked. Every access
 * pins the region (inflight++) for as long as bytes can move into or out of it, so that
 * remove() can refuse with -EBUSY instead of freeing memory under a pending write.
 * Keys carry a generation so a stale key never names a newer region in the same slot.
 */
#ifndef PDKV_REGIONS_H
#define PDKV_REGIONS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "grants.h"

#define PDKV_MAX_GRANTS 64

typedef struct pdkv_region {
    uint64_t key; /* 0: free slot */
    uint8_t *addr;
    uint64_t len;
    uint32_t inflight;
    uint32_t num_grants;
    pdkv_grant grants[PDKV_MAX_GRANTS]; /* [0, num_grants): one per peer */
} pdkv_region;

typedef struct pdkv_regions {
    pthread_mutex_t mu;
    pdkv_region *slots;
    uint32_t cap;
    uint32_t gen;
} pdkv_regions;

void pdkv_regions_init(pdkv_regions *rt);
void pdkv_regions_destroy(pdkv_regions *rt);
int pdkv_regions_add(pdkv_regions *rt, void *addr, uint64_t len, uint64_t *key, char *why, size_t n);
/* Whole-region grant / revoke; revoke is -EBUSY while a write allowed by it is landing. */
int pdkv_regions_grant(pdkv_regions *rt, uint64_t key, uint64_t peer, char *why, size_t n);
int pdkv_regions_revoke(pdkv_regions *rt, uint64_t key, uint64_t peer, char *why, size_t n);
/* Narrow grants: [off, off+len) of `key` for `peer` (inside the region, disjoint per peer). */
int pdkv_regions_grant_range(pdkv_regions *rt, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                             char *why, size_t n);
int pdkv_regions_revoke_range(pdkv_regions *rt, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                              char *why, size_t n);
int pdkv_regions_remove(pdkv_regions *rt, uint64_t key, char *why, size_t n);
/* Check that `peer` may write [off, off+len) of `key` and pin it; *dst gets the address and
 * *ticket what unpin_remote needs. -ENOENT key, -EACCES not granted (that range), -ERANGE bounds. */
int pdkv_regions_pin_remote(pdkv_regions *rt, uint64_t key, uint64_t peer, uint64_t off,
                            uint64_t len, uint8_t **dst, uint64_t *ticket, char *why, size_t n);
void pdkv_regions_unpin_remote(pdkv_regions *rt, uint64_t key, uint64_t peer, uint64_t ticket);
/* Check a local source range [off, off+len) of `key` and pin it. */
int pdkv_regions_pin_local(pdkv_regions *rt, uint64_t key, uint64_t off, uint64_t len,
                           uint8_t **src, char *why, size_t n);
void pdkv_regions_unpin(pdkv_regions *rt, uint64_t key);
/* Drop n pins of `key` at once. */
void pdkv_regions_unpin_n(pdkv_regions *rt, uint64_t key, uint32_t n);
/* Check and pin the sources of n writes under one lock: all or nothing. */
struct pdkv_write;
int pdkv_regions_pin_writes(pdkv_regions *rt, const struct pdkv_write *w, int n, const uint8_t **src,
                            char *why, size_t wn);

#endif
