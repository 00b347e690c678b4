/* pdkv libfabric transport: choosing the provider and domain (fi_getinfo), the fabric, and the
 * objects each peer gets (a domain; per connection an RDM endpoint with its AV and CQ).
 *
 * The hints name what pdkv needs -- FI_EP_RDM, FI_RMA with FI_WRITE / FI_REMOTE_WRITE, remote CQ
 * data -- and every MR mode we can live with (LOCAL, VIRT_ADDR, ALLOCATED, PROV_KEY, ENDPOINT): a
 * provider that demands another one is not chosen. A provider that is missing, or present without a
 * capability we need, is a clear error naming it and the capability (asked again with fewer
 * hints to tell which).
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FB_API FI_VERSION(1, 9) /* fi_writemsg with FI_MORE, fi_context2 */
#define FB_MR_MODES (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | \
                     FI_MR_ENDPOINT)

static struct fi_info *hints_for(const char *prov, uint64_t caps, uint64_t mr_modes)
{
    struct fi_info *h = fbl_dupinfo(NULL);
    if (!h)
        return NULL;
    h->caps = caps;
    h->ep_attr->type = FI_EP_RDM;
    h->mode = FI_CONTEXT | FI_CONTEXT2; /* every write's context is an fb_pending */
    int every = FB_MR_MODES | FI_MR_HMEM; /* explain(): any mode at all */
    h->domain_attr->mr_mode = mr_modes ? (int)mr_modes : every;
    h->domain_attr->threading = FI_THREAD_DOMAIN; /* t->mu serializes every call */
    h->tx_attr->msg_order = FI_ORDER_NONE;
    if (prov && *prov && strcmp(prov, "auto"))
        h->fabric_attr->prov_name = strdup(prov);
    return h;
}

static int get(const char *prov, uint64_t caps, uint64_t mr_modes, struct fi_info **out)
{
    struct fi_info *h = hints_for(prov, caps, mr_modes);
    if (!h)
        return -FI_ENOMEM;
    int rc = fbl_getinfo(FB_API, NULL, NULL, 0, h, out);
    fbl_freeinfo(h);
    return rc;
}

/* Why fi_getinfo found nothing for `prov`: asked again with one requirement dropped at a time. */
static int explain(const char *prov, int rc)
{
    const char *name = prov && *prov ? prov : "auto";
    struct fi_info *i = NULL;
    if (get(prov, 0, 0, &i) || !i)
        return fb_fail(-ENODEV, "libfabric: provider '%s' is not available here (fi_getinfo: %s; "
                                "see `fi_info -l`)", name, fbl_strerror(-rc));
    fbl_freeinfo(i);
    i = NULL;
    if (get(prov, FI_RMA, 0, &i) || !i)
        return fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' lacks FI_RMA on RDM endpoints "
                                    "(one-sided writes)", name);
    fbl_freeinfo(i);
    i = NULL;
    if (get(prov, FI_RMA | FI_WRITE | FI_REMOTE_WRITE, 0, &i) || !i)
        return fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' lacks FI_WRITE / FI_REMOTE_WRITE",
                       name);
    fbl_freeinfo(i);
    return fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' demands an MR mode pdkv does not "
                                "support (it handles FI_MR_LOCAL, VIRT_ADDR, ALLOCATED, PROV_KEY, "
                                "ENDPOINT)", name);
}

/* Does fi_info entry i match a configured name: "domain" or "domain@fabric" (a domain the
 * provider lists under several fabrics, e.g. tcp's "lo" under 127.0.0.1/32 and ::1/128)? */
static int named(const struct fi_info *i, const char *want)
{
    const char *at = strchr(want, '@');
    size_t n = at ? (size_t)(at - want) : strlen(want);
    if (strlen(i->domain_attr->name) != n || strncmp(i->domain_attr->name, want, n))
        return 0;
    return !at || (i->fabric_attr->name && !strcmp(i->fabric_attr->name, at + 1));
}

/* The entry of `all` for `want` (NULL: the first) with 4 bytes of remote CQ data, or NULL +
 * fb_fail naming why. */
static struct fi_info *pick_one(struct fi_info *all, const char *prov, const char *want)
{
    struct fi_info *short_data = NULL;
    for (struct fi_info *i = all; i; i = i->next) {
        if (want && !named(i, want))
            continue;
        if (i->domain_attr->cq_data_size >= FB_IMM_BYTES)
            return i;
        short_data = i;
    }
    const char *name = prov && *prov ? prov : "auto";
    if (short_data)
        fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' carries %zu bytes of remote CQ data; pdkv's "
                             "immediates need %d", name, short_data->domain_attr->cq_data_size,
                FB_IMM_BYTES);
    else
        fb_fail(-ENODEV, "libfabric: provider '%s' has no domain '%s' (its domains: %s%s)", name,
                want, all->domain_attr->name, all->next ? ", ..." : "");
    return NULL;
}

/* Device memory, when asked for: the same provider and domain asked again with FI_HMEM (EFA
 * offers it; the software providers only for system memory, or not at all); when offered, its
 * info replaces dev->info, so that every domain on it can register device memory. */
static int with_hmem(fb_dev *dev)
{
    struct fi_info *hm = NULL;
    int got = 0;
    if (!get(dev->info->fabric_attr->prov_name, FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_HMEM,
             FB_MR_MODES | FI_MR_HMEM, &hm)) {
        for (struct fi_info *i = hm; i && !got; i = i->next)
            if (!strcmp(i->domain_attr->name, dev->info->domain_attr->name) &&
                (!i->fabric_attr->name || !dev->info->fabric_attr->name ||
                 !strcmp(i->fabric_attr->name, dev->info->fabric_attr->name)) &&
                i->domain_attr->cq_data_size >= FB_IMM_BYTES && (i->caps & FI_HMEM)) {
                struct fi_info *dup = fbl_dupinfo(i);
                if (dup) {
                    fbl_freeinfo(dev->info);
                    dev->info = dup;
                    got = 1;
                }
            }
    }
    if (hm)
        fbl_freeinfo(hm);
    return got;
}

/* The devices: one per configured domain name (none: the provider's first), each its own
 * fi_info and fabric. What the key and completion paths rely on (MR mode, key size) is device
 * 0's, and every other device must say the same. */
int fb_open_fabric(fb_transport *t, const pdkv_libfabric_opts *o)
{
    if (fbl_load())
        return -ENODEV;
    const char *prov = o ? o->provider : NULL;
    uint32_t n = 0;
    while (o && o->domains && o->domains[n] && *o->domains[n])
        n++;
    if (n > FB_MAX_DEVS)
        return fb_fail(-EINVAL, "libfabric: 1..%d domains are supported per transport, got %u",
                       FB_MAX_DEVS, n);
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t k = 0; k < i; k++)
            if (!strcmp(o->domains[i], o->domains[k]))
                return fb_fail(-EINVAL, "libfabric: domain '%s' is named twice", o->domains[i]);
    struct fi_info *all = NULL;
    int rc = get(prov, FI_RMA | FI_WRITE | FI_REMOTE_WRITE, FB_MR_MODES, &all);
    if (rc || !all) {
        if (all)
            fbl_freeinfo(all);
        return explain(prov, rc ? rc : -FI_ENODATA);
    }
    int want_hmem = o && (o->device_memory || o->hmem_system);
    t->hmem_asked = want_hmem;
    t->hmem = want_hmem;
    for (uint32_t d = 0; d < (n ? n : 1); d++) {
        struct fi_info *pick = pick_one(all, prov, n ? o->domains[d] : NULL);
        if (!pick) {
            fbl_freeinfo(all);
            return -ENODEV;
        }
        fb_dev *dev = &t->dev[d];
        if (!(dev->info = fbl_dupinfo(pick))) {
            fbl_freeinfo(all);
            return fb_fail(-ENOMEM, "libfabric: out of memory");
        }
        t->num_devs = d + 1;
        snprintf(dev->name, sizeof dev->name, "%s", n ? o->domains[d] : pick->domain_attr->name);
        if (want_hmem && !with_hmem(dev))
            t->hmem = 0; /* device memory only where every device registers it */
        if (d && (dev->info->domain_attr->mr_mode != t->dev[0].info->domain_attr->mr_mode ||
                  strcmp(dev->info->fabric_attr->prov_name,
                         t->dev[0].info->fabric_attr->prov_name))) {
            fbl_freeinfo(all);
            return fb_fail(-EINVAL, "libfabric: domains '%s' and '%s' differ in provider or MR "
                                    "mode: one transport drives alike devices", t->dev[0].name,
                           dev->name);
        }
    }
    fbl_freeinfo(all);
    t->info = t->dev[0].info;
    t->hmem_system = o && o->hmem_system;
    if (t->hmem_system && !t->hmem)
        return fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' has no FI_HMEM: the system-memory "
                                    "stand-in for device memory needs it",
                       t->info->fabric_attr->prov_name);
    snprintf(t->provider, sizeof t->provider, "%s", t->info->fabric_attr->prov_name);
    int mode = t->info->domain_attr->mr_mode;
    t->virt = !!(mode & FI_MR_VIRT_ADDR);
    t->mr_local = !!(mode & FI_MR_LOCAL);
    t->mr_ep = !!(mode & FI_MR_ENDPOINT);
    /* shm drops a refused write without ever completing it at delivery: transmit completion
     * there (the write is then reported done; the immediate the target waits for never comes) */
    t->complete_flag = strcmp(t->provider, "shm") ? FI_DELIVERY_COMPLETE : 0;
    /* bursts with FI_MORE (fabric_post.c): a hint every provider may ignore; PDKV_FABRIC_NO_MORE=1
     * posts each write on its own (A/B in `bench transfer`) */
    const char *no_more = getenv("PDKV_FABRIC_NO_MORE");
    t->batch_more = !(no_more && !strcmp(no_more, "1"));
    t->prov_key = !!(mode & FI_MR_PROV_KEY);
    t->table = t->prov_key || (o && o->table_keys);
    if (t->mr_ep && t->table)
        return fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' binds MRs to endpoints "
                                    "(FI_MR_ENDPOINT) and %s: a grant would have one key per "
                                    "endpoint, pdkv's carry one", t->provider,
                       t->prov_key ? "picks their keys (FI_MR_PROV_KEY)"
                                   : "table_keys asks for provider-style keys");
    if (t->table && !t->virt)
        return fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' picks MR keys (FI_MR_PROV_KEY) "
                                    "without FI_MR_VIRT_ADDR: not supported", t->provider);
    if (!t->prov_key && t->info->domain_attr->mr_key_size &&
        t->info->domain_attr->mr_key_size < (t->table ? 4 : 8))
        return fb_fail(-EOPNOTSUPP, "libfabric: provider '%s' takes %zu-byte MR keys; pdkv's "
                                    "requested keys are 8 bytes", t->provider,
                       t->info->domain_attr->mr_key_size);
    size_t depth = t->info->tx_attr->size;
    t->tx_depth = depth && depth < FB_TX_DEPTH ? (uint32_t)depth : FB_TX_DEPTH;
    for (uint32_t d = 0; d < t->num_devs; d++) {
        size_t dd = t->dev[d].info->tx_attr->size;
        if (dd && dd < t->tx_depth)
            t->tx_depth = (uint32_t)dd;
        rc = fbl_fabric(t->dev[d].info->fabric_attr, &t->dev[d].fabric, NULL);
        if (rc)
            return fb_fail(fb_errno(rc), "libfabric: fi_fabric(%s, %s): %s", t->provider,
                           t->dev[d].name, fbl_strerror(-rc));
    }
    return 0;
}

int fb_open_domain(fb_transport *t, uint32_t dev, struct fid_domain **out)
{
    int rc = fi_domain(t->dev[dev].fabric, t->dev[dev].info, out, NULL);
    if (rc)
        return fb_fail(fb_errno(rc), "libfabric: fi_domain(%s, %s): %s", t->provider,
                       t->dev[dev].name, fbl_strerror(-rc));
    return 0;
}

int fb_mr_reg(fb_transport *t, struct fid_domain *dom, const fb_region *r, uint64_t off,
              uint64_t len, uint64_t access, uint64_t key, struct fid_mr **out)
{
    if (r->iface == FI_HMEM_SYSTEM && r->dmabuf_fd < 0 && !t->hmem_system) {
        int rc = fi_mr_reg(dom, r->addr + off, len, access, 0, key, 0, out, NULL);
        if (rc)
            return fb_fail(fb_errno(rc), "libfabric: fi_mr_reg(%llu bytes) on %s: %s",
                           (unsigned long long)len, t->provider, fbl_strerror(-rc));
        return 0;
    }
    /* device memory (or the stand-in's host memory through the same call) */
    struct iovec iov = {.iov_base = r->addr + off, .iov_len = len};
    struct fi_mr_attr attr = {.mr_iov = &iov, .iov_count = 1, .access = access,
                              .requested_key = key, .iface = r->iface};
    uint64_t flags = 0;
    if (r->iface == FI_HMEM_CUDA)
        attr.device.cuda = (int)r->device;
#ifdef FI_MR_DMABUF
    struct fi_mr_dmabuf dmabuf = {.fd = r->dmabuf_fd, .offset = r->dmabuf_off + off, .len = len,
                                  .base_addr = r->addr + off};
    if (r->dmabuf_fd >= 0)
        attr.dmabuf = &dmabuf, flags |= FI_MR_DMABUF;
#endif
    int rc = fi_mr_regattr(dom, &attr, flags, out);
    if (rc)
        return fb_fail(fb_errno(rc), "libfabric: fi_mr_regattr(%llu bytes of %s memory%s) on %s: %s",
                       (unsigned long long)len, r->iface == FI_HMEM_CUDA ? "CUDA" : "system",
                       r->dmabuf_fd >= 0 ? ", dma-buf" : "", t->provider, fbl_strerror(-rc));
    return 0;
}

int fb_mr_bind_ep(fb_transport *t, struct fid_mr **mr, struct fid_ep *ep)
{
    const char *what = "fi_mr_bind(mr, ep)";
    int rc = fi_mr_bind(*mr, &ep->fid, 0);
    if (!rc)
        what = "fi_mr_enable", rc = fi_mr_enable(*mr);
    if (!rc)
        return 0;
    fi_close(&(*mr)->fid);
    *mr = NULL;
    return fb_fail(fb_errno(rc), "libfabric: %s on %s: %s", what, t->provider, fbl_strerror(-rc));
}

void fb_close_endpoint(fb_conn *c)
{
    /* the endpoint first: once it is closed nothing of this connection lands or completes */
    if (c->ep)
        fi_close(&c->ep->fid);
    if (c->cq)
        fi_close(&c->cq->fid);
    if (c->av)
        fi_close(&c->av->fid);
    c->ep = NULL, c->cq = NULL, c->av = NULL;
}

int fb_open_endpoint(fb_transport *t, struct fid_domain *dom, fb_conn *c)
{
    struct fi_cq_attr cqa = {.size = t->tx_depth * 2, .format = FI_CQ_FORMAT_DATA,
                             .wait_obj = FI_WAIT_NONE};
    struct fi_av_attr ava = {.type = FI_AV_TABLE, .count = 4};
    const char *what = "fi_cq_open";
    int rc = fi_cq_open(dom, &cqa, &c->cq, NULL);
    if (!rc && (what = "fi_av_open", rc = fi_av_open(dom, &ava, &c->av, NULL)) == 0)
        what = "fi_endpoint", rc = fi_endpoint(dom, t->dev[c->dev].info, &c->ep, NULL);
    if (!rc)
        what = "fi_ep_bind(av)", rc = fi_ep_bind(c->ep, &c->av->fid, 0);
    if (!rc)
        what = "fi_ep_bind(cq)", rc = fi_ep_bind(c->ep, &c->cq->fid, FI_TRANSMIT | FI_RECV);
    if (!rc)
        what = "fi_enable", rc = fi_enable(c->ep);
    if (rc) {
        fb_close_endpoint(c);
        return fb_fail(fb_errno(rc), "libfabric: %s on %s: %s", what, t->provider,
                       fbl_strerror(-rc));
    }
    return 0;
}
#endif /* PDKV_HAVE_LIBFABRIC */
