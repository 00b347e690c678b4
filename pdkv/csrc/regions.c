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

void pdkv_regions_destroy(pdkv_regions *rt) {
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

int pdkv_regions_grant(pdkv_regions *rt, uint64_t key, uint64_t peer, char *why, size_t n) {
    int rc = 0;
    pthread_mutex_lock(&rt->mu);
    pdkv_region *r = find(rt, key);
    if (!r) {
        rc = pdkv_seterr(why, n, -ENOENT, "unknown region key 0x%llx", (unsigned long long)key);
    } else {
        uint32_t i;
        for (i = 0; i < r->num_grants && r->grants[i] != peer; i++) {
        }
        if (i == r->num_grants) {
            if (r->num_grants == PDKV_MAX_GRANTS)
                rc = pdkv_seterr(why, n, -ENOSPC, "region 0x%llx already granted to %d peers",
                                 (unsigned long long)key, PDKV_MAX_GRANTS);
            else
                r->grants[r->num_grants++] = peer;
        }
    }
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
        memset(r, 0, sizeof(*r));
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

static int in_bounds(uint64_t off, uint64_t len, uint64_t rlen) {
    /* written without off+len so that it cannot overflow */
    return off <= rlen && len <= rlen - off;
}

int pdkv_regions_pin_remote(pdkv_regions *rt, uint64_t key, uint64_t peer, uint64_t off,
                            uint64_t len, uint8_t **dst, char *why, size_t n) {
    int rc = 0;
    pthread_mutex_lock(&rt->mu);
    pdkv_region *r = find(rt, key);
    if (!r) {
        rc = pdkv_seterr(why, n, -ENOENT, "write to unknown region key 0x%llx", (unsigned long long)key);
    } else {
        uint32_t i;
        for (i = 0; i < r->num_grants && r->grants[i] != peer; i++) {
        }
        if (i == r->num_grants)
            rc = pdkv_seterr(why, n, -EACCES, "region 0x%llx is not granted to peer %llu",
                             (unsigned long long)key, (unsigned long long)peer);
        else if (!in_bounds(off, len, r->len))
            rc = pdkv_seterr(why, n, -ERANGE,
                             "write [%llu, +%llu) outside region 0x%llx of %llu bytes",
                             (unsigned long long)off, (unsigned long long)len,
                             (unsigned long long)key, (unsigned long long)r->len);
        else {
            r->inflight++;
            *dst = r->addr + off;
        }
    }
    pthread_mutex_unlock(&rt->mu);
    return rc;
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
