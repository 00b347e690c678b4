/* pdkv verbs transport: memory regions and the grants peers write through.
 *
 * Shared mode (isolate_peers off): a region is one MR in t->pd with REMOTE_WRITE and its key
 * carries that MR's rkey: holding the key is the permission (the old model, kept so callers that
 * ignore grant()'s key keep working). grant/revoke check the key only; narrow grants are refused.
 *
 * isolate_peers: the region's own MR is local-only; a grant registers the region (or, for a
 * narrow grant, exactly [off, off+len) of it) with REMOTE_WRITE in the peer's protection domain
 * (verbs_domain.c) and returns a key with that MR's rkey. The NIC then refuses, with a remote
 * access error and before a byte lands, a write by any other peer (its QPs are in another PD),
 * outside the range, or after revoke (the MR is gone). A range MR is registered with
 * iova = pgoff + off, so writes name the same region offsets under the range's key.
 * NOTE: ranges cost one MR each; RDMA has no finer protection than an MR (or a memory window,
 * which costs the same: one rkey per range), so a narrow grant is one contiguous range.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

vb_region *vb_find_region(vb_transport *t, uint64_t key)
{
    uint32_t idx = VB_KEY_INDEX(key);
    if (!idx || idx > t->num_regions || !t->regions[idx - 1].key)
        return NULL;
    vb_region *r = &t->regions[idx - 1];
    /* our own key, or (isolate_peers) a key of one of its grants: same index and page offset */
    return r->key == key || (t->isolate && VB_KEY_PGOFF(key) == r->pgoff) ? r : NULL;
}

int vb_reg(pdkv_transport *base, void *addr, uint64_t len, uint64_t *key_out)
{
    vb_transport *t = (vb_transport *)base;
    if (!addr || !len) {
        vb_fail(t, "verbs: cannot register an empty region (addr %p, len %llu)", addr,
                (unsigned long long)len);
        return -EINVAL;
    }
    uint64_t pgoff = (uintptr_t)addr & (t->page_size - 1);
    int access = IBV_ACCESS_LOCAL_WRITE | (t->isolate ? 0 : IBV_ACCESS_REMOTE_WRITE);
    errno = 0;
    struct ibv_mr *mr = ibv_reg_mr_iova(t->pd, addr, len, pgoff, access);
    if (!mr) {
        int e = errno ? errno : ENOMEM;
        vb_fail(t, "verbs: ibv_reg_mr(%p, %llu) failed: %s%s", addr, (unsigned long long)len,
                strerror(e), e == ENOMEM || e == EPERM
                                 ? " (locked-memory limit: raise `ulimit -l` or grant CAP_IPC_LOCK)" : "");
        return -e;
    }
    vb_region proto = {.addr = addr, .len = len, .pgoff = pgoff};
    return vb_add_region(t, mr, &proto, key_out);
}

int vb_add_region(vb_transport *t, struct ibv_mr *mr, const vb_region *proto, uint64_t *key_out)
{
    pthread_mutex_lock(&t->mu);
    uint32_t i = 0;
    while (i < t->num_regions && t->regions[i].key)
        i++;
    if (i == VB_MAX_REGIONS) {
        pthread_mutex_unlock(&t->mu);
        ibv_dereg_mr(mr);
        vb_fail(t, "verbs: too many regions (%d)", VB_MAX_REGIONS);
        return -ENOSPC;
    }
    if (i == t->num_regions)
        t->num_regions++;
    vb_region *r = &t->regions[i];
    *r = *proto;
    r->mr = mr;
    r->inflight = 0;
    r->key = VB_KEY(i, r->pgoff, t->isolate ? 0 : mr->rkey);
    int rc = 0;
    for (uint32_t k = 0; t->isolate && !rc && k < VB_MAX_DOMAINS; k++)
        if (t->domains[k].used)
            rc = vb_domain_add_region(t, &t->domains[k], i);
    if (rc) {
        vb_domain_drop_region(t, i);
        ibv_dereg_mr(mr);
        memset(r, 0, sizeof *r);
    } else {
        *key_out = r->key;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* Register [off, off+len) of region r for `peer` (whole: the region); caller holds t->mu. */
static int add_grant(vb_transport *t, vb_region *r, uint64_t peer, int whole, uint64_t off,
                     uint64_t len, uint64_t *key_out)
{
    uint32_t i = (uint32_t)(r - t->regions);
    vb_domain *d = vb_domain_get(t, peer, 1);
    if (!d)
        return -ENOMEM;
    for (uint32_t g = 0; g < d->num_grants; g++) {
        vb_grant_mr *x = &d->grants[g];
        if (x->region != i || x->whole != whole)
            continue;
        if (whole || (x->off == off && x->len == len)) { /* granted already: the same key */
            *key_out = VB_KEY(i, r->pgoff, x->mr->rkey);
            return 0;
        }
        if (off < x->off + x->len && x->off < off + len) {
            vb_fail(t, "verbs: range [%llu, +%llu) overlaps the range [%llu, +%llu) already granted to peer %llu",
                    (unsigned long long)off, (unsigned long long)len, (unsigned long long)x->off,
                    (unsigned long long)x->len, (unsigned long long)peer);
            return -EEXIST;
        }
    }
    if (d->num_grants == d->grants_cap) {
        uint32_t cap = d->grants_cap ? d->grants_cap * 2 : 16;
        vb_grant_mr *n = realloc(d->grants, cap * sizeof *n);
        if (!n) {
            vb_fail(t, "verbs: out of memory");
            vb_domain_tidy(t, d);
            return -ENOMEM;
        }
        d->grants = n;
        d->grants_cap = cap;
    }
    errno = 0;
    struct ibv_mr *mr = vb_mr_reg(d->pd, r, off, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!mr) {
        int e = errno ? errno : ENOMEM;
        vb_fail(t, "verbs: cannot register the grant of [%llu, +%llu) for peer %llu: %s",
                (unsigned long long)off, (unsigned long long)len, (unsigned long long)peer, strerror(e));
        vb_domain_tidy(t, d);
        return -e;
    }
    d->grants[d->num_grants++] = (vb_grant_mr){.mr = mr, .region = i, .whole = whole, .off = off, .len = len};
    *key_out = VB_KEY(i, r->pgoff, mr->rkey);
    return 0;
}

static int drop_grant(vb_transport *t, vb_region *r, uint64_t peer, int whole, uint64_t off, uint64_t len)
{
    uint32_t i = (uint32_t)(r - t->regions);
    vb_domain *d = vb_domain_get(t, peer, 0);
    for (uint32_t g = 0; d && g < d->num_grants; g++) {
        vb_grant_mr *x = &d->grants[g];
        if (x->region == i && x->whole == whole && (whole || (x->off == off && x->len == len))) {
            /* after this returns the NIC refuses every access through the grant's rkey; a
             * provider still using the MR says EBUSY: the grant stays, the caller retries */
            if (vb_dereg_busy(ibv_dereg_mr(x->mr))) {
                vb_fail(t, "verbs: the grant's MR is still in use by the device (EBUSY): revoke again");
                return -EBUSY;
            }
            d->grants[g] = d->grants[--d->num_grants];
            vb_domain_tidy(t, d);
            return 0;
        }
    }
    if (whole)
        vb_fail(t, "verbs: region 0x%llx is not wholly granted to peer %llu", (unsigned long long)r->key,
                (unsigned long long)peer);
    else
        vb_fail(t, "verbs: range [%llu, +%llu) is not granted to peer %llu", (unsigned long long)off,
                (unsigned long long)len, (unsigned long long)peer);
    return -ENOENT;
}

/* Common checks of the grant calls (add: a grant, not a revoke); caller holds t->mu. NULL + rc
 * when refused. */
static vb_region *grantable(vb_transport *t, uint64_t key, int add, int narrow, uint64_t off, uint64_t len,
                            int *rc)
{
    vb_region *r = vb_find_region(t, key);
    *rc = 0;
    if (!r) {
        vb_fail(t, "verbs: grant of unknown key 0x%llx", (unsigned long long)key);
        *rc = -ENOENT;
    } else if (add && r->dying) {
        vb_fail(t, "verbs: region 0x%llx is being deregistered (an MR was busy; deregister it again)",
                (unsigned long long)r->key);
        *rc = -ENOENT;
    } else if (narrow && !t->isolate) {
        vb_fail(t, "verbs: narrow grants need isolate_peers (a protection domain per peer): in shared "
                   "mode the region's key opens all of it to every peer");
        *rc = -EINVAL;
    } else if (narrow && (!len || off > r->len || len > r->len - off)) {
        vb_fail(t, "verbs: range [%llu, +%llu) is empty or outside the region of %llu bytes",
                (unsigned long long)off, (unsigned long long)len, (unsigned long long)r->len);
        *rc = -ERANGE;
    }
    return *rc ? NULL : r;
}

int vb_grant(pdkv_transport *base, uint64_t key, uint64_t peer, uint64_t *key_out)
{
    vb_transport *t = (vb_transport *)base;
    uint64_t out = key;
    int rc;
    pthread_mutex_lock(&t->mu);
    vb_region *r = grantable(t, key, 1, 0, 0, 0, &rc);
    if (r && t->isolate)
        rc = add_grant(t, r, peer, 1, 0, r->len, &out);
    pthread_mutex_unlock(&t->mu);
    if (!rc && key_out)
        *key_out = out;
    return rc;
}

int vb_revoke(pdkv_transport *base, uint64_t key, uint64_t peer)
{
    vb_transport *t = (vb_transport *)base;
    int rc;
    pthread_mutex_lock(&t->mu);
    vb_region *r = grantable(t, key, 0, 0, 0, 0, &rc);
    if (r && t->isolate)
        rc = drop_grant(t, r, peer, 1, 0, 0);
    else if (r) { /* shared mode cannot take a key back from a peer that holds it */
        vb_fail(t, "verbs: revoke needs isolate_peers (in shared mode the key is the permission)");
        rc = -EINVAL;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int vb_grant_range(pdkv_transport *base, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                   uint64_t *key_out)
{
    vb_transport *t = (vb_transport *)base;
    uint64_t out = 0;
    int rc;
    pthread_mutex_lock(&t->mu);
    vb_region *r = grantable(t, key, 1, 1, off, len, &rc);
    if (r)
        rc = add_grant(t, r, peer, 0, off, len, &out);
    pthread_mutex_unlock(&t->mu);
    if (!rc && key_out)
        *key_out = out;
    return rc;
}

/* -EBUSY (the device still uses the range's MR): nothing changed, the grant stays; retry. */
int vb_revoke_range(pdkv_transport *base, uint64_t key, uint64_t peer, uint64_t off, uint64_t len)
{
    vb_transport *t = (vb_transport *)base;
    int rc;
    pthread_mutex_lock(&t->mu);
    vb_region *r = grantable(t, key, 0, 1, off, len, &rc);
    if (r)
        rc = drop_grant(t, r, peer, 0, off, len);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int vb_dereg(pdkv_transport *base, uint64_t key)
{
    vb_transport *t = (vb_transport *)base;
    pthread_mutex_lock(&t->mu);
    vb_region *r = vb_find_region(t, key);
    int rc = 0;
    if (!r || r->key != key) {
        vb_fail(t, "verbs: dereg of unknown key 0x%llx", (unsigned long long)key);
        rc = -ENOENT;
    } else if (r->inflight) {
        vb_fail(t, "verbs: region 0x%llx has %u writes in flight", (unsigned long long)key,
                r->inflight);
        rc = -EBUSY;
    } else {
        /* the region's own MR first: a provider that is still using it says EBUSY, and then
         * nothing has changed (its grants too are still in place): the caller retries. Then
         * its per-peer and grant MRs: one still in use stays, the region dies (no new write or
         * grant) and the next call deregisters what is left */
        int e = r->dying ? 0 : ibv_dereg_mr(r->mr);
        if (vb_dereg_busy(e)) {
            vb_fail(t, "verbs: ibv_dereg_mr of region 0x%llx: the device is still using it (EBUSY)",
                    (unsigned long long)key);
            rc = -EBUSY;
        } else {
            if (e) {
                vb_fail(t, "verbs: ibv_dereg_mr failed: %s", strerror(e > 0 ? e : errno));
                rc = -EIO;
            }
            r->mr = NULL;
            uint32_t busy = vb_domain_drop_region(t, (uint32_t)(r - t->regions));
            if (busy) {
                r->dying = 1;
                vb_fail(t, "verbs: ibv_dereg_mr of %u per-peer or grant MR(s) of region 0x%llx: the device "
                           "is still using them (EBUSY); the region takes no new writes or grants: "
                           "deregister it again to finish", busy, (unsigned long long)key);
                rc = -EBUSY;
            } else {
                if (r->dmabuf)
                    close(r->dmabuf_fd);
                memset(r, 0, sizeof *r);
            }
        }
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

#endif /* PDKV_HAVE_VERBS */
