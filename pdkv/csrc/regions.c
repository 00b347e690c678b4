/* Registered-memory table (see regions.h). */
#include "regions.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cq.h"
#include "transport.h"

#define SLOT_BITS 24
#define SLOT_MASK ((1u << SLOT_BITS) - 1)

void pdkv_regions_init(pdkv_regions *rt) {
    memset(rt, 0, sizeof(*rt));
    pthread_mutex_init(&rt->mu, NULL);
}

static void clear_region(pdkv_region *r) {
    for (uint32_t i = 0; i < r->num_grants; i++) pdkv_grant_free(&r->grants[i]);
    memset(r, 0, sizeof(*r));
}

void pdkv_regions_destroy(pdkv_regions *rt) {
    for (uint32_t i = 0; i < rt->cap; i++) clear_region(&rt->slots[i]);
    free(rt->slots);
    rt->slots = NULL;
    pthread_mutex_destroy(&rt->mu);
}

/* Caller holds mu. */
static pdkv_region *find(pdkv_regions *rt, uint64_t key) {
    uint32_t slot = (uint32_t)(key & SLOT_MASK);
    if (key == 0 || slot == 0 || slot > rt->cap) return NULL;
    pdkv_region *r = &rt->slots[slot - 1];
    return r->key == key ? r : NULL;
}

int pdkv_regions_add(pdkv_regions *rt, void *addr, uint64_t len, uint64_t *key, char *why, size_t n) {
    if (!addr || len == 0) return pdkv_seterr(why, n, -EINVAL, "region must have an address and a non-zero length");
    if ((uint64_t)(uintptr_t)addr + len < (uint64_t)(uintptr_t)addr)
        return pdkv_seterr(why, n, -EOVERFLOW, "region [%p, +%llu) wraps the address space", addr,
                           (unsigned long long)len);
    pthread_mutex_lock(&rt->mu);
    uint32_t i;
    for (i = 0; i < rt->cap && rt->slots[i].key; i++) {
    }
    if (i == rt->cap) {
        uint32_t ncap = rt->cap ? rt->cap * 2 : 16;
        if (ncap > SLOT_MASK) {
            pthread_mutex_unlock(&rt->mu);
            return pdkv_seterr(why, n, -ENOSPC, "too many registered regions");
        }
        pdkv_region *s = realloc(rt->slots, (size_t)ncap * sizeof(*s));
        if (!s) {
            pthread_mutex_unlock(&rt->mu);
            return pdkv_seterr(why, n, -ENOMEM, "out of memory");
        }
        memset(s + rt->cap, 0, (size_t)(ncap - rt->cap) * sizeof(*s));
        rt->slots = s;
        rt->cap = ncap;
    }
    rt->gen++;
    pdkv_region *r = &rt->slots[i];
    memset(r, 0, sizeof(*r));
    r->key = ((uint64_t)rt->gen << SLOT_BITS) | (i + 1);
    r->addr = addr;
    r->len = len;
    *key = r->key;
    pthread_mutex_unlock(&rt->mu);
    return 0;
}

/* The grant of `peer` in r (caller holds mu); with create, a new empty one if there is none. */
static pdkv_grant *grant_of(pdkv_region *r, uint64_t peer, int create, int *full) {
    for (uint32_t i = 0; i < r->num_grants; i++)
        if (r->grants[i].peer == peer) return &r->grants[i];
    if (!create) return NULL;
    if (r->num_grants == PDKV_MAX_GRANTS) {
        *full = 1;
        return NULL;
    }
    pdkv_grant *g = &r->grants[r->num_grants++];
    memset(g, 0, sizeof(*g));
    g->peer = peer;
    return g;
}

/* Drop g from r if it allows nothing any more (caller holds mu). */
static void tidy(pdkv_region *r, pdkv_grant *g) {
    if (!pdkv_grant_empty(g)) return;
    pdkv_grant_free(g);
    uint32_t i = (uint32_t)(g - r->grants);
    r->grants[i] = r->grants[--r->num_grants];
}

static int in_bounds(uint64_t off, uint64_t len, uint64_t rlen) {
    /* written without off+len so that it cannot overflow */
    return off <= rlen && len <= rlen - off;
}

/* The grant of `peer` in region `key`, checked (caller holds mu); NULL with *rc set. */
static pdkv_grant *lookup(pdkv_regions *rt, uint64_t key, uint64_t peer, int create, pdkv_region **out,
                          int *rc, char *why, size_t n) {
    pdkv_region *r = find(rt, key);
    int full = 0;
    pdkv_grant *g = r ? grant_of(r, peer, create, &full) : NULL;
    if (!r)
        *rc = pdkv_seterr(why, n, -ENOENT, "unknown region key 0x%llx", (unsigned long long)key);
    else if (full)
        *rc = pdkv_seterr(why, n, -ENOSPC, "region 0x%llx already granted to %d peers", (unsigned long long)key,
                          PDKV_MAX_GRANTS);
    else if (!g)
        *rc = pdkv_seterr(why, n, -ENOENT, "region 0x%llx is not granted to peer %llu", (unsigned long long)key,
                          (unsigned long long)peer);
    *out = r;
    return g;
}

int pdkv_regions_grant(pdkv_regions *rt, uint64_t key, uint64_t peer, char *why, size_t n) {
    int rc = 0;
    pdkv_region *r;
    pthread_mutex_lock(&rt->mu);
    pdkv_grant *g = lookup(rt, key, peer, 1, &r, &rc, why, n);
    if (g) g->whole = 1;
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

int pdkv_regions_revoke(pdkv_regions *rt, uint64_t key, uint64_t peer, char *why, size_t n) {
    int rc = 0;
    pdkv_region *r;
    pthread_mutex_lock(&rt->mu);
    pdkv_grant *g = lookup(rt, key, peer, 0, &r, &rc, why, n);
    if (g && !g->whole)
        rc = pdkv_seterr(why, n, -ENOENT, "region 0x%llx is not wholly granted to peer %llu",
                         (unsigned long long)key, (unsigned long long)peer);
    else if (g && g->landing_whole)
        rc = pdkv_seterr(why, n, -EBUSY, "a write from peer %llu into region 0x%llx is still landing",
                         (unsigned long long)peer, (unsigned long long)key);
    else if (g) {
        g->whole = 0;
        tidy(r, g);
    }
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

int pdkv_regions_grant_range(pdkv_regions *rt, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                             char *why, size_t n) {
    int rc = 0;
    pdkv_region *r;
    pthread_mutex_lock(&rt->mu);
    pdkv_region *probe = find(rt, key);
    if (probe && !in_bounds(off, len, probe->len)) {
        rc = pdkv_seterr(why, n, -ERANGE, "range [%llu, +%llu) outside region 0x%llx of %llu bytes",
                         (unsigned long long)off, (unsigned long long)len, (unsigned long long)key,
                         (unsigned long long)probe->len);
    } else {
        pdkv_grant *g = lookup(rt, key, peer, 1, &r, &rc, why, n);
        if (g && (rc = pdkv_grant_add_range(g, off, len, why, n)) < 0) tidy(r, g);
    }
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

int pdkv_regions_revoke_range(pdkv_regions *rt, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                              char *why, size_t n) {
    int rc = 0;
    pdkv_region *r;
    pthread_mutex_lock(&rt->mu);
    pdkv_grant *g = lookup(rt, key, peer, 0, &r, &rc, why, n);
    if (g && (rc = pdkv_grant_remove_range(g, off, len, why, n)) == 0) tidy(r, g);
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

int pdkv_regions_remove(pdkv_regions *rt, uint64_t key, char *why, size_t n) {
    int rc = 0;
    pthread_mutex_lock(&rt->mu);
    pdkv_region *r = find(rt, key);
    if (!r)
        rc = pdkv_seterr(why, n, -ENOENT, "unknown region key 0x%llx", (unsigned long long)key);
    else if (r->inflight)
        rc = pdkv_seterr(why, n, -EBUSY, "region 0x%llx has %u writes in flight",
                         (unsigned long long)key, r->inflight);
    else
        clear_region(r);
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

int pdkv_regions_pin_remote(pdkv_regions *rt, uint64_t key, uint64_t peer, uint64_t off,
                            uint64_t len, uint8_t **dst, uint64_t *ticket, char *why, size_t n) {
    int rc = 0;
    pthread_mutex_lock(&rt->mu);
    pdkv_region *r = find(rt, key);
    int full = 0;
    pdkv_grant *g = r ? grant_of(r, peer, 0, &full) : NULL;
    if (!r)
        rc = pdkv_seterr(why, n, -ENOENT, "write to unknown region key 0x%llx", (unsigned long long)key);
    else if (!g)
        rc = pdkv_seterr(why, n, -EACCES, "region 0x%llx is not granted to peer %llu",
                         (unsigned long long)key, (unsigned long long)peer);
    else if (!in_bounds(off, len, r->len))
        rc = pdkv_seterr(why, n, -ERANGE,
                         "write [%llu, +%llu) outside region 0x%llx of %llu bytes",
                         (unsigned long long)off, (unsigned long long)len,
                         (unsigned long long)key, (unsigned long long)r->len);
    else if (pdkv_grant_admit(g, off, len, ticket) < 0)
        rc = pdkv_seterr(why, n, -EACCES,
                         "write [%llu, +%llu) of region 0x%llx is outside every range granted to peer %llu",
                         (unsigned long long)off, (unsigned long long)len, (unsigned long long)key,
                         (unsigned long long)peer);
    else {
        r->inflight++;
        *dst = r->addr + off;
    }
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

void pdkv_regions_unpin_remote(pdkv_regions *rt, uint64_t key, uint64_t peer, uint64_t ticket) {
    pthread_mutex_lock(&rt->mu);
    pdkv_region *r = find(rt, key);
    int full = 0;
    pdkv_grant *g = r ? grant_of(r, peer, 0, &full) : NULL;
    if (r && r->inflight) r->inflight--;
    if (g) pdkv_grant_landed(g, ticket);
    pthread_mutex_unlock(&rt->mu);
}

int pdkv_regions_pin_local(pdkv_regions *rt, uint64_t key, uint64_t off, uint64_t len,
                           uint8_t **src, char *why, size_t n) {
    int rc = 0;
    pthread_mutex_lock(&rt->mu);
    pdkv_region *r = find(rt, key);
    if (!r)
        rc = pdkv_seterr(why, n, -ENOENT, "unknown local region key 0x%llx", (unsigned long long)key);
    else if (!in_bounds(off, len, r->len))
        rc = pdkv_seterr(why, n, -ERANGE, "source [%llu, +%llu) outside local region 0x%llx of %llu bytes",
                         (unsigned long long)off, (unsigned long long)len,
                         (unsigned long long)key, (unsigned long long)r->len);
    else {
        r->inflight++;
        *src = r->addr + off;
    }
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

void pdkv_regions_unpin(pdkv_regions *rt, uint64_t key) {
    pthread_mutex_lock(&rt->mu);
    pdkv_region *r = find(rt, key);
    if (r && r->inflight) r->inflight--;
    pthread_mutex_unlock(&rt->mu);
}

void pdkv_regions_unpin_n(pdkv_regions *rt, uint64_t key, uint32_t n) {
    pthread_mutex_lock(&rt->mu);
    pdkv_region *r = find(rt, key);
    if (r) r->inflight = r->inflight > n ? r->inflight - n : 0;
    pthread_mutex_unlock(&rt->mu);
}

int pdkv_regions_pin_writes(pdkv_regions *rt, const pdkv_write *w, int n, const uint8_t **src,
                            char *why, size_t wn) {
    pthread_mutex_lock(&rt->mu);
    pdkv_region *r = NULL;
    for (int i = 0; i < n; i++) {
        if (!r || r->key != w[i].lkey) r = find(rt, w[i].lkey);
        int rc = 0;
        if (!r)
            rc = pdkv_seterr(why, wn, -ENOENT, "write %d: unknown local region key 0x%llx", i,
                             (unsigned long long)w[i].lkey);
        else if (!in_bounds(w[i].loff, w[i].len, r->len))
            rc = pdkv_seterr(why, wn, -ERANGE, "write %d: source [%llu, +%llu) outside local region 0x%llx of %llu bytes",
                             i, (unsigned long long)w[i].loff, (unsigned long long)w[i].len,
                             (unsigned long long)w[i].lkey, (unsigned long long)r->len);
        if (rc < 0) {
            for (int j = 0; j < i; j++) { /* undo */
                pdkv_region *u = find(rt, w[j].lkey);
                if (u && u->inflight) u->inflight--;
            }
            pthread_mutex_unlock(&rt->mu);
            return rc;
        }
        r->inflight++;
        src[i] = r->addr + w[i].loff;
    }
    pthread_mutex_unlock(&rt->mu);
    return 0;
}
