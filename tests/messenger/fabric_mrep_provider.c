/* TEST DOUBLE, never part of pdkv: "mrep_double", a libfabric provider (loaded as a DL provider
 * through FI_PROVIDER_PATH, built by tests/messenger/fabrics.py) that demands FI_MR_ENDPOINT,
 * which no provider installed here does. It wraps a real provider (MREP_DOUBLE_INNER, default
 * "tcp;ofi_rxm") and delegates every call pdkv makes to the inner provider's objects; only the
 * MR rules are its own, enforced for real:
 *  - getinfo answers only when named (so "auto" never picks it) and when the hints accept
 *    FI_MR_ENDPOINT, and reports the inner provider's mr_mode | FI_MR_ENDPOINT;
 *  - an MR is made disabled: no inner MR exists, so a write naming its key is refused by the
 *    inner provider; fi_mr_bind to one of its endpoints (once), then fi_mr_enable registers the
 *    inner MR -- enable without a bind fails -FI_EINVAL;
 *  - keys are scoped to the endpoint an MR is bound to, as the mode says: the inner MR's key is
 *    the requested key XOR a hash of that endpoint's name, and a write's key is turned the same
 *    way with the name of the endpoint it is sent to (fi_av_lookup): an MR bound to endpoint A
 *    is nothing to a write that reaches endpoint B, even under the same key.
 * Written against the public headers only (rdma/providers/fi_prov.h: fi_prov_ini) and linked
 * with -lfabric (pdkv loads libfabric RTLD_LOCAL: its symbols are not global); wraps only
 * what pdkv calls (fabric, domain, endpoint with fi_writemsg and fi_getname, MRs; AVs and CQs
 * are the inner provider's own objects). Records: MREP_DOUBLE_LOG=path appends one line per MR
 * event ("<pid> bind|enable|close key=<hex> ..."). Fault injection: MREP_DOUBLE_FAULT=bind makes
 * fi_mr_bind fail -FI_ENOSYS (what tcp;ofi_rxm and shm answer), =bind_remote only for MRs a peer
 * may write (FI_REMOTE_WRITE: grants), so that connections still work. */
#define _GNU_SOURCE
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/providers/fi_prov.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define NAME "mrep_double"
#define MAX_IOV 4
#define MAX_PEERS 64

static const char *inner_name(void)
{
    const char *n = getenv("MREP_DOUBLE_INNER");
    return n && *n ? n : "tcp;ofi_rxm";
}

static void note(const char *fmt, unsigned long long key, unsigned long long extra)
{
    const char *path = getenv("MREP_DOUBLE_LOG");
    FILE *f = path && *path ? fopen(path, "a") : NULL;
    if (!f)
        return;
    fprintf(f, "%d ", (int)getpid());
    fprintf(f, fmt, key, extra);
    fputc('\n', f);
    fclose(f);
}

/* An endpoint's scope: FNV-1a of its name, trailing zero bytes left out (an AV may hand the
 * name back padded to its address length). */
static uint64_t scope_of(const uint8_t *name, size_t len)
{
    while (len && !name[len - 1])
        len--;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ name[i]) * 0x100000001b3ull;
    return h | 1;
}

/* The info the inner provider made, under its own name and modes. */
static struct fi_info *inner_info(const struct fi_info *info)
{
    struct fi_info *i = fi_dupinfo(info);
    if (!i)
        return NULL;
    free(i->fabric_attr->prov_name);
    i->fabric_attr->prov_name = strdup(inner_name());
    i->domain_attr->mr_mode &= ~FI_MR_ENDPOINT;
    return i;
}

/* --- endpoints ------------------------------------------------------------------------------ */
struct mrep_ep {
    struct fid_ep ep;
    struct fid_ep *inner;
    struct fid_av *av;
    struct fi_info *info;
    uint32_t num_peers;
    struct { fi_addr_t addr; uint64_t scope; } peers[MAX_PEERS];
};

static int ep_close(struct fid *fid)
{
    struct mrep_ep *e = (struct mrep_ep *)fid;
    int rc = fi_close(&e->inner->fid);
    fi_freeinfo(e->info);
    free(e);
    return rc;
}

static int ep_bind(struct fid *fid, struct fid *bfid, uint64_t flags)
{
    struct mrep_ep *e = (struct mrep_ep *)fid;
    if (bfid->fclass == FI_CLASS_AV)
        e->av = (struct fid_av *)bfid;
    return e->inner->fid.ops->bind(&e->inner->fid, bfid, flags);
}

static int ep_control(struct fid *fid, int command, void *arg)
{
    struct mrep_ep *e = (struct mrep_ep *)fid;
    return e->inner->fid.ops->control(&e->inner->fid, command, arg);
}

static int no_ops_open(struct fid *fid, const char *name, uint64_t flags, void **ops, void *ctx)
{
    (void)fid, (void)name, (void)flags, (void)ops, (void)ctx;
    return -FI_ENOSYS;
}

static struct fi_ops ep_fid_ops = {.size = sizeof(struct fi_ops), .close = ep_close,
                                   .bind = ep_bind, .control = ep_control,
                                   .ops_open = no_ops_open};

static ssize_t ep_cancel(fid_t fid, void *ctx)
{
    struct mrep_ep *e = (struct mrep_ep *)fid;
    return e->inner->ops->cancel(&e->inner->fid, ctx);
}
static int ep_getopt(fid_t fid, int level, int name, void *val, size_t *len)
{
    struct mrep_ep *e = (struct mrep_ep *)fid;
    return e->inner->ops->getopt(&e->inner->fid, level, name, val, len);
}
static int ep_setopt(fid_t fid, int level, int name, const void *val, size_t len)
{
    struct mrep_ep *e = (struct mrep_ep *)fid;
    return e->inner->ops->setopt(&e->inner->fid, level, name, val, len);
}
static int no_ctx(struct fid_ep *sep, int i, void *attr, struct fid_ep **out, void *ctx)
{
    (void)sep, (void)i, (void)attr, (void)out, (void)ctx;
    return -FI_ENOSYS;
}
static ssize_t ep_rx_left(struct fid_ep *ep)
{
    return ((struct mrep_ep *)ep)->inner->ops->rx_size_left(((struct mrep_ep *)ep)->inner);
}
static ssize_t ep_tx_left(struct fid_ep *ep)
{
    return ((struct mrep_ep *)ep)->inner->ops->tx_size_left(((struct mrep_ep *)ep)->inner);
}

static struct fi_ops_ep ep_ops = {
    .size = sizeof(struct fi_ops_ep), .cancel = ep_cancel, .getopt = ep_getopt,
    .setopt = ep_setopt,
    .tx_ctx = (int (*)(struct fid_ep *, int, struct fi_tx_attr *, struct fid_ep **, void *))no_ctx,
    .rx_ctx = (int (*)(struct fid_ep *, int, struct fi_rx_attr *, struct fid_ep **, void *))no_ctx,
    .rx_size_left = ep_rx_left, .tx_size_left = ep_tx_left};

static int ep_getname(fid_t fid, void *addr, size_t *len)
{
    struct mrep_ep *e = (struct mrep_ep *)fid;
    return e->inner->cm->getname(&e->inner->fid, addr, len);
}

static struct fi_ops_cm ep_cm = {.size = sizeof(struct fi_ops_cm), .getname = ep_getname};

static int own_scope(struct mrep_ep *e, uint64_t *out)
{
    uint8_t name[256];
    size_t len = sizeof name;
    int rc = e->inner->cm->getname(&e->inner->fid, name, &len);
    if (!rc)
        *out = scope_of(name, len < sizeof name ? len : sizeof name);
    return rc;
}

/* The scope of the endpoint at `dest` (its name in the AV), cached per address. */
static int dest_scope(struct mrep_ep *e, fi_addr_t dest, uint64_t *out)
{
    for (uint32_t i = 0; i < e->num_peers; i++)
        if (e->peers[i].addr == dest)
            return *out = e->peers[i].scope, 0;
    if (!e->av)
        return -FI_EINVAL;
    uint8_t name[256];
    size_t len = sizeof name;
    int rc = e->av->ops->lookup(e->av, dest, name, &len);
    if (rc)
        return rc;
    *out = scope_of(name, len < sizeof name ? len : sizeof name);
    if (e->num_peers < MAX_PEERS)
        e->peers[e->num_peers].addr = dest, e->peers[e->num_peers++].scope = *out;
    return 0;
}

static ssize_t ep_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags)
{
    struct mrep_ep *e = (struct mrep_ep *)ep;
    uint64_t scope;
    if (msg->rma_iov_count > MAX_IOV)
        return -FI_EINVAL;
    int rc = dest_scope(e, msg->addr, &scope);
    if (rc)
        return rc;
    struct fi_rma_iov rma[MAX_IOV];
    for (size_t i = 0; i < msg->rma_iov_count; i++)
        rma[i] = msg->rma_iov[i], rma[i].key ^= scope;
    struct fi_msg_rma m = *msg;
    m.rma_iov = rma;
    return e->inner->rma->writemsg(e->inner, &m, flags);
}

static struct fi_ops_rma ep_rma = {.size = sizeof(struct fi_ops_rma), .writemsg = ep_writemsg};

/* --- memory regions ------------------------------------------------------------------------- */
struct mrep_domain {
    struct fid_domain dom;
    struct fid_domain *inner;
    struct fi_info *info;
};

struct mrep_mr {
    struct fid_mr mr;
    struct mrep_domain *dom;
    struct fi_mr_attr attr;
    struct iovec iov[MAX_IOV];
    uint64_t flags;
    struct mrep_ep *ep;       /* bound to (only for enable: its name gives the scope) */
    struct fid_mr *inner;     /* NULL until enabled: the key names nothing */
};

static int mr_close(struct fid *fid)
{
    struct mrep_mr *m = (struct mrep_mr *)fid;
    note("close key=0x%llx enabled=%llu", m->mr.key, m->inner != NULL);
    int rc = m->inner ? fi_close(&m->inner->fid) : 0;
    free(m);
    return rc;
}

static int mr_bind(struct fid *fid, struct fid *bfid, uint64_t flags)
{
    struct mrep_mr *m = (struct mrep_mr *)fid;
    const char *fault = getenv("MREP_DOUBLE_FAULT");
    if (fault && (!strcmp(fault, "bind") ||
                  (!strcmp(fault, "bind_remote") && (m->attr.access & FI_REMOTE_WRITE)))) {
        note("refused-bind key=0x%llx access=0x%llx", m->mr.key, m->attr.access);
        return -FI_ENOSYS;
    }
    if (bfid->fclass != FI_CLASS_EP || bfid->ops != &ep_fid_ops || flags || m->ep || m->inner)
        return -FI_EINVAL; /* one of our endpoints, once, before enable */
    m->ep = (struct mrep_ep *)bfid;
    note("bind key=0x%llx ep=0x%llx", m->mr.key, (unsigned long long)(uintptr_t)m->ep);
    return 0;
}

static int mr_control(struct fid *fid, int command, void *arg)
{
    struct mrep_mr *m = (struct mrep_mr *)fid;
    (void)arg;
    if (command != FI_ENABLE)
        return -FI_ENOSYS;
    if (!m->ep || m->inner) {
        note("refused-enable key=0x%llx bound=%llu", m->mr.key, m->ep != NULL);
        return -FI_EINVAL;
    }
    uint64_t scope;
    int rc = own_scope(m->ep, &scope);
    if (rc)
        return rc;
    struct fi_mr_attr a = m->attr;
    a.mr_iov = m->iov;
    a.requested_key = m->mr.key ^ scope;
    rc = m->dom->inner->mr->regattr(&m->dom->inner->fid, &a, m->flags, &m->inner);
    if (rc)
        return m->inner = NULL, rc;
    m->mr.mem_desc = fi_mr_desc(m->inner);
    note("enable key=0x%llx scope=0x%llx", m->mr.key, scope);
    return 0;
}

static struct fi_ops mr_fid_ops = {.size = sizeof(struct fi_ops), .close = mr_close,
                                   .bind = mr_bind, .control = mr_control,
                                   .ops_open = no_ops_open};

static int mr_regattr(struct fid *fid, const struct fi_mr_attr *attr, uint64_t flags,
                      struct fid_mr **out)
{
    struct mrep_domain *d = (struct mrep_domain *)fid;
    if (attr->iov_count < 1 || attr->iov_count > MAX_IOV)
        return -FI_EINVAL;
    struct mrep_mr *m = calloc(1, sizeof *m);
    if (!m)
        return -FI_ENOMEM;
    m->mr.fid = (struct fid){.fclass = FI_CLASS_MR, .context = attr->context,
                             .ops = &mr_fid_ops};
    m->mr.key = attr->requested_key;
    m->dom = d, m->attr = *attr, m->flags = flags;
    memcpy(m->iov, attr->mr_iov, attr->iov_count * sizeof *m->iov);
    *out = &m->mr;
    return 0;
}

static int mr_regv(struct fid *fid, const struct iovec *iov, size_t count, uint64_t access,
                   uint64_t offset, uint64_t key, uint64_t flags, struct fid_mr **mr, void *ctx)
{
    struct fi_mr_attr a = {.mr_iov = iov, .iov_count = count, .access = access,
                           .offset = offset, .requested_key = key, .context = ctx};
    return mr_regattr(fid, &a, flags, mr);
}

static int mr_reg(struct fid *fid, const void *buf, size_t len, uint64_t access, uint64_t offset,
                  uint64_t key, uint64_t flags, struct fid_mr **mr, void *ctx)
{
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    return mr_regv(fid, &iov, 1, access, offset, key, flags, mr, ctx);
}

static struct fi_ops_mr dom_mr = {.size = sizeof(struct fi_ops_mr), .reg = mr_reg,
                                  .regv = mr_regv, .regattr = mr_regattr};

/* --- domains and the fabric ----------------------------------------------------------------- */
static int dom_close(struct fid *fid)
{
    struct mrep_domain *d = (struct mrep_domain *)fid;
    int rc = fi_close(&d->inner->fid);
    fi_freeinfo(d->info);
    free(d);
    return rc;
}

static struct fi_ops dom_fid_ops = {.size = sizeof(struct fi_ops), .close = dom_close,
                                    .ops_open = no_ops_open};

static int dom_av_open(struct fid_domain *dom, struct fi_av_attr *attr, struct fid_av **av,
                       void *ctx)
{
    struct fid_domain *in = ((struct mrep_domain *)dom)->inner;
    return in->ops->av_open(in, attr, av, ctx);
}

static int dom_cq_open(struct fid_domain *dom, struct fi_cq_attr *attr, struct fid_cq **cq,
                       void *ctx)
{
    struct fid_domain *in = ((struct mrep_domain *)dom)->inner;
    return in->ops->cq_open(in, attr, cq, ctx);
}

static int dom_endpoint(struct fid_domain *dom, struct fi_info *info, struct fid_ep **out,
                        void *ctx)
{
    struct mrep_domain *d = (struct mrep_domain *)dom;
    struct mrep_ep *e = calloc(1, sizeof *e);
    int rc = e && (e->info = inner_info(info)) ? 0 : -FI_ENOMEM;
    if (rc || (rc = d->inner->ops->endpoint(d->inner, e->info, &e->inner, ctx)))
        return e ? fi_freeinfo(e->info) : (void)0, free(e), rc;
    e->ep.fid = (struct fid){.fclass = FI_CLASS_EP, .context = ctx, .ops = &ep_fid_ops};
    e->ep.ops = &ep_ops, e->ep.cm = &ep_cm, e->ep.rma = &ep_rma;
    *out = &e->ep;
    return 0;
}

static struct fi_ops_domain dom_ops = {.size = sizeof(struct fi_ops_domain),
                                       .av_open = dom_av_open, .cq_open = dom_cq_open,
                                       .endpoint = dom_endpoint};

struct mrep_fabric {
    struct fid_fabric fab;
    struct fid_fabric *inner;
};

static int fab_domain(struct fid_fabric *fab, struct fi_info *info, struct fid_domain **out,
                      void *ctx)
{
    struct mrep_fabric *f = (struct mrep_fabric *)fab;
    struct mrep_domain *d = calloc(1, sizeof *d);
    int rc = d && (d->info = inner_info(info)) ? 0 : -FI_ENOMEM;
    if (rc || (rc = f->inner->ops->domain(f->inner, d->info, &d->inner, ctx)))
        return d ? fi_freeinfo(d->info) : (void)0, free(d), rc;
    d->dom.fid = (struct fid){.fclass = FI_CLASS_DOMAIN, .context = ctx, .ops = &dom_fid_ops};
    d->dom.ops = &dom_ops, d->dom.mr = &dom_mr;
    *out = &d->dom;
    return 0;
}

static int fab_close(struct fid *fid)
{
    struct mrep_fabric *f = (struct mrep_fabric *)fid;
    int rc = fi_close(&f->inner->fid);
    free(f);
    return rc;
}

static struct fi_ops fab_fid_ops = {.size = sizeof(struct fi_ops), .close = fab_close,
                                    .ops_open = no_ops_open};
static struct fi_ops_fabric fab_ops = {.size = sizeof(struct fi_ops_fabric),
                                       .domain = fab_domain};

static int mrep_fabric(struct fi_fabric_attr *attr, struct fid_fabric **out, void *ctx)
{
    struct mrep_fabric *f = calloc(1, sizeof *f);
    if (!f)
        return -FI_ENOMEM;
    struct fi_fabric_attr a = *attr;
    a.prov_name = (char *)inner_name();
    int rc = fi_fabric(&a, &f->inner, ctx);
    if (rc) {
        free(f);
        return rc;
    }
    f->fab.fid = (struct fid){.fclass = FI_CLASS_FABRIC, .context = ctx, .ops = &fab_fid_ops};
    f->fab.ops = &fab_ops;
    *out = &f->fab;
    return 0;
}

static int mrep_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                        const struct fi_info *hints, struct fi_info **info)
{
    if (!hints || !hints->fabric_attr || !hints->fabric_attr->prov_name ||
        strcmp(hints->fabric_attr->prov_name, NAME) || !hints->domain_attr ||
        !(hints->domain_attr->mr_mode & FI_MR_ENDPOINT))
        return -FI_ENODATA; /* only when named, and only for an application that binds MRs */
    struct fi_info *h = inner_info(hints), *got = NULL;
    if (!h)
        return -FI_ENOMEM;
    int rc = fi_getinfo(version, node, service, flags, h, &got);
    fi_freeinfo(h);
    if (rc)
        return rc;
    for (struct fi_info *i = got; i; i = i->next) {
        free(i->fabric_attr->prov_name); /* the core names the entries after us */
        i->fabric_attr->prov_name = NULL;
        i->domain_attr->mr_mode |= FI_MR_ENDPOINT;
    }
    *info = got;
    return 0;
}

static void mrep_cleanup(void) {}

static struct fi_provider mrep_prov = {
    .version = FI_VERSION(0, 1),
    .fi_version = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION),
    .name = NAME,
    .getinfo = mrep_getinfo,
    .fabric = mrep_fabric,
    .cleanup = mrep_cleanup,
};

FI_EXT_INI
{
    return &mrep_prov;
}
