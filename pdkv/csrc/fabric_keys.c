/* pdkv libfabric transport: the keys grants are named by (fabric_internal.h has their layout).
 * Our requested keys: a narrow grant's key is a random tag with the base the writer aims from.
 * Provider keys (FI_MR_PROV_KEY, EFA; or the table_keys stand-in, which draws them itself as a
 * provider would): the MR is registered first and named by the key it got.
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <stdio.h>

/* A narrow grant's key: a random tag with `base` on the domain's device, unused by the domain's
 * live grants. */
int fb_narrow_key(fb_domain *d, uint64_t base, uint64_t *out)
{
    for (int tries = 0; tries < 1 << 20; tries++) {
        d->tag_seed = d->tag_seed * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t tag = FB_NARROW | (uint32_t)d->dev << (FB_DEV_SHIFT - 48) |
                       ((uint32_t)(d->tag_seed >> 50) & FB_TAG_BITS);
        uint64_t key = FB_WKEY(tag, base);
        int taken = 0;
        for (uint32_t i = 0; i < d->num_grants && !taken; i++)
            taken = d->grants[i].wkey == key;
        if (!taken)
            return *out = key, 0;
    }
    return fb_fail(-ENOSPC, "libfabric: no free key for another grant of peer %llu",
                   (unsigned long long)d->peer);
}

/* Provider keys: register, then name the MR by the key the provider gave it (the stand-in picks
 * a random 32-bit one as a provider would; the real thing ignores what we ask for). */
int fb_table_grant(fb_transport *t, fb_domain *d, uint32_t region, uint64_t off, uint64_t len,
                   struct fid_mr **mr, uint64_t *wkey)
{
    fb_region *r = &t->regions[region];
    uint64_t want = 0;
    for (int taken = 1; !t->prov_key && taken;) {
        d->tag_seed = d->tag_seed * 6364136223846793005ull + 1442695040888963407ull;
        want = (d->tag_seed >> 32) | 1;
        taken = 0;
        for (uint32_t i = 0; i < d->num_grants && !taken; i++)
            taken = d->grants[i].wkey >> 32 == want;
    }
    int rc = fb_mr_reg(t, d->dom, r, off, len, FI_REMOTE_WRITE, want, mr);
    if (rc)
        return rc;
    uint64_t key = fi_mr_key(*mr);
    if (key == FI_KEY_NOTAVAIL || key > UINT32_MAX) {
        fi_close(&(*mr)->fid);
        return fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' gave an MR key of more than 32 bits "
                                    "(0x%llx): pdkv's keys carry 32", t->provider,
                       (unsigned long long)key);
    }
    *wkey = FB_TKEY(key, region, d->dev);
    return 0;
}
#endif /* PDKV_HAVE_LIBFABRIC */
