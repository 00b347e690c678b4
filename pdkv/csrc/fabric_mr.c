/* pdkv libfabric transport: regions, the per-peer domains, and the grants peers write through.
 * With several devices a peer has a domain on each device it uses (opened with its first
 * connection or grant there); a key's device bits say which (fabric_internal.h).
 *
 * A region is a slot in t->regions plus, in every peer's domain, a local-only MR (FI_WRITE |
 * FI_READ: the source of our writes, its descriptor for FI_MR_LOCAL providers). Nothing is
 * remotely writable until a grant: an MR with FI_REMOTE_WRITE over the region (grant) or over
 * exactly [off, off+len) of it (grant_range), in that peer's domain, with a key we choose
 * (FB_WKEY: a tag and the base the writer aims from). The provider refuses a write naming a key
 * it does not have, or reaching outside the MR; libfabric keys are domain-wide, hence a domain
 * per peer: another peer's key opens nothing in it. revoke closes the MR.
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LOCAL_ACCESS (FI_WRITE | FI_READ)

/* A region's key names it on any device (FB_ON_DEV): the device bits are not compared. */
fb_region *fb_find_region(fb_transport *t, uint64_t key)
{
    uint32_t idx = FB_RKEY_INDEX(key);
    if (!idx || idx > t->num_regions || FB_KEY_DEV(key) >= t->num_devs ||
        t->regions[idx - 1].key != FB_ON_DEV(key, 0))
        return NULL;
    return &t->regions[idx - 1];
}

int fb_nic_key(pdkv_transport *base, uint64_t key, uint32_t dev, uint64_t *key_out)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    int rc = 0;
    if (!fb_find_region(t, key))
        rc = fb_fail(-ENOENT, "libfabric: unknown key 0x%llx", (unsigned long long)key);
    else if (dev >= t->num_devs)
        rc = fb_fail(-EINVAL, "libfabric: domain %u does not exist: this transport drives %u "
                              "domains", dev, t->num_devs);
    else
        *key_out = FB_ON_DEV(key, dev);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* A region's local MR in domain d (under FI_MR_ENDPOINT none: each endpoint has its own). */
static int add_local(fb_transport *t, fb_domain *d, uint32_t i)
{
    fb_region *r = &t->regions[i];
    if (t->mr_ep)
        return 0;
    return fb_mr_reg(t, d->dom, r, 0, r->len, LOCAL_ACCESS, FB_LKEY(i), &d->lmr[i]);
}

fb_domain *fb_domain_get(fb_transport *t, uint64_t peer, uint32_t dev, int create)
{
    fb_domain *free_slot = NULL;
    for (uint32_t i = 0; i < FB_MAX_DOMAINS; i++) {
        if (t->domains[i].used && t->domains[i].peer == peer && t->domains[i].dev == dev)
            return &t->domains[i];
        if (!t->domains[i].used && !free_slot)
            free_slot = &t->domains[i];
    }
    if (!create)
        return NULL;
    if (!free_slot) {
        fb_fail(-ENOSPC, "libfabric: too many (peer, device) domains (%d)", FB_MAX_DOMAINS);
        return NULL;
    }
    fb_domain *d = free_slot;
    memset(d, 0, sizeof *d);
    d->lmr = calloc(FB_MAX_REGIONS, sizeof *d->lmr);
    if (!d->lmr) {
        fb_fail(-ENOMEM, "libfabric: out of memory");
        return NULL;
    }
    d->dev = dev;
    if (fb_open_domain(t, dev, &d->dom)) {
        free(d->lmr);
        return NULL;
    }
    d->used = 1;
    d->peer = peer;
    d->tag_seed = (peer * 0x9e3779b97f4a7c15ull) ^ (uint64_t)(uintptr_t)d->dom ^ dev;
    for (uint32_t i = 0; i < t->num_regions; i++)
        if (t->regions[i].key && add_local(t, d, i)) {
            fb_domain_free(t, d);
            return NULL;
        }
    return d;
}

static void close_grant(fb_grant_mr *g)
{
    if (g->mr)
        fi_close(&g->mr->fid);
    fb_ep_grant_close(g);
}

void fb_domain_free(fb_transport *t, fb_domain *d)
{
    for (uint32_t i = 0; i < d->num_grants; i++)
        close_grant(&d->grants[i]);
    for (uint32_t i = 0; d->lmr && i < t->num_regions; i++)
        if (d->lmr[i])
            fi_close(&d->lmr[i]->fid);
    if (d->dom)
        fi_close(&d->dom->fid);
    free(d->grants);
    free(d->lmr);
    memset(d, 0, sizeof *d);
}

void fb_domain_tidy(fb_transport *t, fb_domain *d)
{
    if (d->used && !d->num_conns && !d->num_grants)
        fb_domain_free(t, d);
}

/* A region of host memory (iface FI_HMEM_SYSTEM, no dma-buf) or of device memory. */
static int reg_region(fb_transport *t, void *addr, uint64_t len, int iface, uint64_t device,
                      int dmabuf_fd, uint64_t dmabuf_off, uint64_t *key_out)
{
    if (!addr || !len)
        return fb_fail(-EINVAL, "libfabric: cannot register an empty region (addr %p, len %llu)",
                       addr, (unsigned long long)len);
    if ((uintptr_t)addr + len > (1ull << 48))
        return fb_fail(-EINVAL, "libfabric: region %p beyond 48-bit addresses (keys carry 48)",
                       addr);
    pthread_mutex_lock(&t->mu);
    uint32_t i = 0;
    while (i < t->num_regions && t->regions[i].key)
        i++;
    int rc = 0;
    if (i == FB_MAX_REGIONS) {
        rc = fb_fail(-ENOSPC, "libfabric: too many regions (%d)", FB_MAX_REGIONS);
        goto out;
    }
    if (i == t->num_regions)
        t->num_regions++;
    fb_region *r = &t->regions[i];
    *r = (fb_region){.addr = addr, .len = len,
                     .key = FB_RKEY(i, t->virt && !t->table ? (uint64_t)(uintptr_t)addr : 0),
                     .iface = iface, .device = device, .dmabuf_fd = dmabuf_fd,
                     .dmabuf_off = dmabuf_off};
    for (uint32_t k = 0; !rc && k < FB_MAX_DOMAINS; k++)
        if (t->domains[k].used)
            rc = add_local(t, &t->domains[k], i);
    if (!rc && t->mr_ep)
        rc = fb_ep_region(t, i);
    if (rc) {
        for (uint32_t k = 0; k < FB_MAX_DOMAINS; k++)
            if (t->domains[k].used && t->domains[k].lmr[i])
                fi_close(&t->domains[k].lmr[i]->fid), t->domains[k].lmr[i] = NULL;
        r->key = 0;
        goto out;
    }
    *key_out = r->key;
out:
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int fb_reg(pdkv_transport *base, void *addr, uint64_t len, uint64_t *key_out)
{
    return reg_region((fb_transport *)base, addr, len, FI_HMEM_SYSTEM, 0, -1, 0, key_out);
}

/* Device (GPU) memory, what EFA offers through FI_HMEM: first the dma-buf `fd` at `offset`
 * (FI_MR_DMABUF, libfabric >= 1.20), then the device pointer `addr` (FI_HMEM_CUDA: the provider
 * resolves it through the CUDA driver). The region is then one like any other: its local MR in
 * every peer's domain and every grant of it are registered naming the same memory. A provider
 * without FI_HMEM is refused with the fix (stage through host memory); the stand-in
 * (hmem_system) takes host memory through the same calls with iface FI_HMEM_SYSTEM. */
int fb_reg_device(pdkv_transport *base, int fd, uint64_t offset, uint64_t len, void *addr,
                  uint64_t *key_out, uint32_t *method_out)
{
    fb_transport *t = (fb_transport *)base;
    if (!t->hmem && !t->hmem_system)
        return fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' does not register device memory "
                                    "(%s): GPU KV is staged through host memory (messenger.staging "
                                    "auto)", t->provider, t->hmem_asked ? "no FI_HMEM / FI_MR_HMEM"
                       : "the transport was made without device_memory");
    int iface = t->hmem_system ? FI_HMEM_SYSTEM : FI_HMEM_CUDA;
    char why_dmabuf[PDKV_REASON_MAX] = "no dma-buf fd given";
    if (fd >= 0) {
#ifdef FI_MR_DMABUF
        int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        if (dup_fd < 0) {
            snprintf(why_dmabuf, sizeof why_dmabuf, "dup of dma-buf fd %d: %s", fd, strerror(errno));
        } else {
            /* the address peers aim at: the device pointer when given, else the offset */
            void *at = addr ? addr : (void *)(uintptr_t)offset;
            int rc = reg_region(t, at, len, iface, 0, dup_fd, offset, key_out);
            if (!rc) {
                *method_out = PDKV_REG_DMABUF;
                return 0;
            }
            close(dup_fd);
            snprintf(why_dmabuf, sizeof why_dmabuf, "%s", fb_errbuf());
        }
#else
        snprintf(why_dmabuf, sizeof why_dmabuf, "these libfabric headers (%d.%d) predate "
                 "FI_MR_DMABUF (1.20)", FI_MAJOR_VERSION, FI_MINOR_VERSION);
#endif
    }
    if (!addr)
        return fb_fail(-EOPNOTSUPP, "libfabric: cannot register device memory: dma-buf: %s; "
                                    "device pointer: none given", why_dmabuf);
    int rc = reg_region(t, addr, len, iface, 0, -1, 0, key_out);
    if (rc)
        return fb_fail(rc == -EINVAL ? -EINVAL : -EOPNOTSUPP, "libfabric: cannot register device "
                       "memory: dma-buf: %s; device pointer (FI_HMEM): %s", why_dmabuf,
                       fb_errbuf());
    *method_out = PDKV_REG_HMEM;
    return 0;
}

static int add_grant(fb_transport *t, fb_domain *d, uint32_t region, int whole, uint64_t off,
                     uint64_t len, uint64_t *key_out)
{
    if (d->num_grants == FB_MAX_GRANTS)
        return fb_fail(-ENOSPC, "libfabric: peer %llu holds %d grants already",
                       (unsigned long long)d->peer, FB_MAX_GRANTS);
    if (d->num_grants == d->grants_cap &&
        fb_grow((void **)&d->grants, &d->grants_cap, sizeof *d->grants, 64))
        return -ENOMEM;
    fb_region *r = &t->regions[region];
    uint64_t wkey = FB_ON_DEV(r->key, d->dev);
    struct fid_mr *mr = NULL;
    int rc;
    if (t->table) {
        rc = fb_table_grant(t, d, region, off, len, &mr, &wkey);
    } else {
        rc = whole ? 0 : fb_narrow_key(d, t->virt ? (uint64_t)(uintptr_t)r->addr : off, &wkey);
        if (!rc && !t->mr_ep)
            rc = fb_mr_reg(t, d->dom, r, off, len, FI_REMOTE_WRITE, wkey, &mr);
    }
    if (rc)
        return rc;
    fb_grant_mr *g = &d->grants[d->num_grants];
    *g = (fb_grant_mr){.mr = mr, .region = region, .whole = whole, .off = off, .len = len,
                       .wkey = wkey};
    if (t->mr_ep && (rc = fb_ep_grant(t, d, g)))
        return rc; /* the key is handed out only once every endpoint's MR is bound and enabled */
    d->num_grants++;
    if (key_out)
        *key_out = wkey;
    return 0;
}

static void drop_grant(fb_domain *d, uint32_t i)
{
    close_grant(&d->grants[i]);
    d->grants[i] = d->grants[--d->num_grants];
}

int fb_grant(pdkv_transport *base, uint64_t key, uint64_t peer, uint64_t *key_out)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    int rc = 0;
    fb_region *r = fb_find_region(t, key);
    fb_domain *d = r ? fb_domain_get(t, peer, FB_KEY_DEV(key), 1) : NULL;
    if (!r)
        rc = fb_fail(-ENOENT, "libfabric: grant: unknown key 0x%llx", (unsigned long long)key);
    else if (!d)
        rc = -ENOMEM;
    for (uint32_t i = 0; d && i < d->num_grants; i++)
        if (d->grants[i].whole && d->grants[i].region == (uint32_t)(r - t->regions)) {
            if (key_out)
                *key_out = d->grants[i].wkey;
            goto out; /* granting again changes nothing */
        }
    if (d)
        rc = add_grant(t, d, (uint32_t)(r - t->regions), 1, 0, r->len, key_out);
    if (d && rc)
        fb_domain_tidy(t, d);
out:
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int fb_revoke(pdkv_transport *base, uint64_t key, uint64_t peer)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    fb_region *r = fb_find_region(t, key);
    fb_domain *d = fb_domain_get(t, peer, r ? FB_KEY_DEV(key) : 0, 0);
    int rc = fb_fail(-ENOENT, "libfabric: revoke: peer %llu holds no grant of key 0x%llx",
                     (unsigned long long)peer, (unsigned long long)key);
    for (uint32_t i = 0; r && d && i < d->num_grants; i++)
        if (d->grants[i].whole && d->grants[i].region == (uint32_t)(r - t->regions)) {
            drop_grant(d, i);
            fb_domain_tidy(t, d);
            rc = 0;
            break;
        }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int fb_grant_range(pdkv_transport *base, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                   uint64_t *key_out)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    int rc = 0;
    fb_region *r = fb_find_region(t, key);
    fb_domain *d = NULL;
    if (!r)
        rc = fb_fail(-ENOENT, "libfabric: grant_range: unknown key 0x%llx",
                     (unsigned long long)key);
    else if (!len || off > r->len || len > r->len - off)
        rc = fb_fail(-ERANGE, "libfabric: grant_range [%llu, +%llu) is outside the region of "
                              "%llu bytes", (unsigned long long)off, (unsigned long long)len,
                     (unsigned long long)r->len);
    else if (!(d = fb_domain_get(t, peer, FB_KEY_DEV(key), 1)))
        rc = -ENOMEM;
    uint32_t region = r ? (uint32_t)(r - t->regions) : 0;
    for (uint32_t i = 0; d && !rc && i < d->num_grants; i++) {
        fb_grant_mr *g = &d->grants[i];
        if (g->region == region && !g->whole && off < g->off + g->len && g->off < off + len)
            rc = fb_fail(-EEXIST, "libfabric: grant_range [%llu, +%llu) overlaps peer %llu's "
                                  "range [%llu, +%llu)", (unsigned long long)off,
                         (unsigned long long)len, (unsigned long long)peer,
                         (unsigned long long)g->off, (unsigned long long)g->len);
    }
    if (d && !rc)
        rc = add_grant(t, d, region, 0, off, len, key_out);
    if (d && rc)
        fb_domain_tidy(t, d);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int fb_revoke_range(pdkv_transport *base, uint64_t key, uint64_t peer, uint64_t off, uint64_t len)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    fb_region *r = fb_find_region(t, key);
    /* a region's key on the device, or the grant's own key (its device bits where its kind
     * keeps them) */
    uint32_t dev = !r && t->table && (key & FB_TABLE_FLAG) ? FB_TKEY_DEV(key) : FB_KEY_DEV(key);
    fb_domain *d = fb_domain_get(t, peer, dev, 0);
    int rc = fb_fail(-ENOENT, "libfabric: revoke_range: [%llu, +%llu) of key 0x%llx is not "
                              "granted to peer %llu", (unsigned long long)off,
                     (unsigned long long)len, (unsigned long long)key, (unsigned long long)peer);
    for (uint32_t i = 0; d && i < d->num_grants; i++) {
        fb_grant_mr *g = &d->grants[i];
        int named = r ? g->region == (uint32_t)(r - t->regions) : g->wkey == key;
        if (named && !g->whole && g->off == off && g->len == len) {
            drop_grant(d, i);
            fb_domain_tidy(t, d);
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int fb_dereg(pdkv_transport *base, uint64_t key)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    int rc = 0;
    fb_region *r = fb_find_region(t, key);
    if (!r) {
        rc = fb_fail(-ENOENT, "libfabric: deregister: unknown key 0x%llx", (unsigned long long)key);
    } else if (r->inflight) {
        rc = fb_fail(-EBUSY, "libfabric: region 0x%llx has %u writes in flight",
                     (unsigned long long)key, r->inflight);
    } else {
        uint32_t idx = (uint32_t)(r - t->regions);
        for (uint32_t k = 0; k < FB_MAX_DOMAINS; k++) {
            fb_domain *d = &t->domains[k];
            if (!d->used)
                continue;
            for (uint32_t i = d->num_grants; i-- > 0;)
                if (d->grants[i].region == idx)
                    drop_grant(d, i);
            if (d->lmr[idx])
                fi_close(&d->lmr[idx]->fid), d->lmr[idx] = NULL;
            fb_domain_tidy(t, d);
        }
        if (t->mr_ep)
            fb_ep_region_close(t, idx);
        if (r->dmabuf_fd >= 0)
            close(r->dmabuf_fd);
        r->key = 0;
        while (t->num_regions && !t->regions[t->num_regions - 1].key)
            t->num_regions--;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}
#endif /* PDKV_HAVE_LIBFABRIC */
