/* Per-peer grants of a region: whole or narrow (sorted disjoint byte ranges). See grants.h. */
#include "grants.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cq.h"

int pdkv_grant_empty(const pdkv_grant *g) {
    if (g->whole || g->landing_whole || g->num_ranges) return 0;
    return 1;
}

void pdkv_grant_free(pdkv_grant *g) {
    free(g->ranges);
    memset(g, 0, sizeof(*g));
}

/* Index of the first range with off > x (binary search). */
static uint32_t upper(const pdkv_grant *g, uint64_t x) {
    uint32_t lo = 0, hi = g->num_ranges;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (g->ranges[mid].off <= x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int pdkv_grant_add_range(pdkv_grant *g, uint64_t off, uint64_t len, char *why, size_t n) {
    if (len == 0 || off + len < off)
        return pdkv_seterr(why, n, -EINVAL, "range [%llu, +%llu) is empty or wraps 64 bits",
                           (unsigned long long)off, (unsigned long long)len);
    uint32_t i = upper(g, off); /* ranges[i-1].off <= off < ranges[i].off */
    const pdkv_range *prev = i ? &g->ranges[i - 1] : NULL, *next = i < g->num_ranges ? &g->ranges[i] : NULL;
    if ((prev && prev->off + prev->len > off) || (next && off + len > next->off)) {
        const pdkv_range *o = prev && prev->off + prev->len > off ? prev : next;
        return pdkv_seterr(why, n, -EEXIST, "range [%llu, +%llu) overlaps the range [%llu, +%llu) already granted to peer %llu",
                           (unsigned long long)off, (unsigned long long)len, (unsigned long long)o->off,
                           (unsigned long long)o->len, (unsigned long long)g->peer);
    }
    if (g->num_ranges == PDKV_MAX_RANGES)
        return pdkv_seterr(why, n, -ENOSPC, "peer %llu already holds %d ranges of this region",
                           (unsigned long long)g->peer, PDKV_MAX_RANGES);
    if (g->num_ranges == g->cap) {
        uint32_t cap = g->cap ? g->cap * 2 : 16;
        pdkv_range *r = realloc(g->ranges, (size_t)cap * sizeof(*r));
        if (!r) return pdkv_seterr(why, n, -ENOMEM, "out of memory");
        g->ranges = r;
        g->cap = cap;
    }
    memmove(&g->ranges[i + 1], &g->ranges[i], (size_t)(g->num_ranges - i) * sizeof(*g->ranges));
    g->ranges[i] = (pdkv_range){.off = off, .len = len};
    g->num_ranges++;
    return 0;
}

int pdkv_grant_remove_range(pdkv_grant *g, uint64_t off, uint64_t len, char *why, size_t n) {
    uint32_t i = upper(g, off);
    pdkv_range *r = i ? &g->ranges[i - 1] : NULL;
    if (!r || r->off != off || r->len != len)
        return pdkv_seterr(why, n, -ENOENT, "range [%llu, +%llu) is not granted to peer %llu",
                           (unsigned long long)off, (unsigned long long)len, (unsigned long long)g->peer);
    if (r->landing)
        return pdkv_seterr(why, n, -EBUSY, "a write from peer %llu into range [%llu, +%llu) is still landing",
                           (unsigned long long)g->peer, (unsigned long long)off, (unsigned long long)len);
    memmove(r, r + 1, (size_t)(g->num_ranges - i) * sizeof(*r));
    g->num_ranges--;
    return 0;
}

int pdkv_grant_admit(pdkv_grant *g, uint64_t off, uint64_t len, uint64_t *ticket) {
    if (g->whole) {
        g->landing_whole++;
        *ticket = PDKV_TICKET_WHOLE;
        return 0;
    }
    uint32_t i = upper(g, off);
    pdkv_range *r = i ? &g->ranges[i - 1] : NULL;
    /* off - r->off <= r->len and len <= what is left: no overflow */
    if (!r || off - r->off > r->len || len > r->len - (off - r->off)) return -EACCES;
    r->landing++;
    *ticket = r->off;
    return 0;
}

void pdkv_grant_landed(pdkv_grant *g, uint64_t ticket) {
    if (ticket == PDKV_TICKET_WHOLE) {
        if (g->landing_whole) g->landing_whole--;
        return;
    }
    uint32_t i = upper(g, ticket);
    if (i && g->ranges[i - 1].off == ticket && g->ranges[i - 1].landing) g->ranges[i - 1].landing--;
}
