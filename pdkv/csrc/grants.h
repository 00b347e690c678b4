/* Per-peer write grants of one registered region (tcp and fake; verbs enforces the same rules in
 * the NIC, see verbs_mr.c).
 *
 * A peer may write into a region only while it holds a grant: the whole region, or a set of
 * byte ranges (narrow grants: the pages reserved for the requests the peer was sent). Ranges of
 * one peer never overlap, are kept sorted, and a write must lie inside ONE range. Each grant
 * counts the writes landing under it, so that revoking a range (or the whole grant) is -EBUSY
 * while a write that was allowed by it can still put bytes into the region; once a revoke
 * returns 0, nothing that peer sends can land there.
 */
#ifndef PDKV_GRANTS_H
#define PDKV_GRANTS_H

#include <stddef.h>
#include <stdint.h>

#define PDKV_MAX_RANGES 65536 /* ranges per (region, peer): a bound, not a working size */
#define PDKV_TICKET_WHOLE UINT64_MAX

typedef struct pdkv_range {
    uint64_t off, len;
    uint32_t landing; /* writes allowed by this range that are still landing */
} pdkv_range;

typedef struct pdkv_grant {
    uint64_t peer;
    int whole;              /* the whole region is granted */
    uint32_t landing_whole; /* writes allowed by the whole grant, still landing */
    pdkv_range *ranges;     /* sorted by off, disjoint */
    uint32_t num_ranges, cap;
} pdkv_grant;

/* 1 when the grant allows nothing and nothing is landing under it (it can be dropped). */
int pdkv_grant_empty(const pdkv_grant *g);
void pdkv_grant_free(pdkv_grant *g);
/* Add [off, off+len): -EINVAL empty, -EEXIST overlapping another range, -ENOSPC, -ENOMEM. */
int pdkv_grant_add_range(pdkv_grant *g, uint64_t off, uint64_t len, char *why, size_t n);
/* Remove exactly [off, off+len): -ENOENT if not granted, -EBUSY while a write lands under it. */
int pdkv_grant_remove_range(pdkv_grant *g, uint64_t off, uint64_t len, char *why, size_t n);
/* May the peer write [off, off+len)? 0 and a ticket for pdkv_grant_landed(), or -EACCES. */
int pdkv_grant_admit(pdkv_grant *g, uint64_t off, uint64_t len, uint64_t *ticket);
/* The write admitted with `ticket` finished landing (or failed). */
void pdkv_grant_landed(pdkv_grant *g, uint64_t ticket);

#endif
