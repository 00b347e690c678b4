/* pdkv libfabric transport: one-sided writes with 32-bit immediates over any libfabric provider
 * with RDM endpoints, FI_RMA and remote CQ data -- AWS EFA ("efa") and, in software,
 * "tcp;ofi_rxm", "sockets" and "shm" (transport.h; the verbs transport is the RC twin).
 *
 * This file holds the function table, creation and teardown, and calls down
 * (fabric_internal.h lists the order).
 *
 * Shape (what fabric-lib and NIXL's libfabric backend do, fitted to pdkv's seam):
 *  - one provider and one or more devices (fabric domain names: an EFA device each) chosen at
 *    create (fi_getinfo, fabric_setup.c); a key names the device a write leaves or lands
 *    through (nic_key), which the layer above picks per TP rank (the device nearest its GPU,
 *    pdkv/messenger.py), as on the verbs transport over several NICs;
 *  - a fabric domain per peer and device, so MR keys -- domain-wide in libfabric -- open
 *    nothing to any other peer (the verbs transport's protection domain per peer); grants are
 *    MRs in it;
 *  - per connection an RDM endpoint (with its own AV and CQ) per (local device, remote device)
 *    pair its writes use (fabric_link.c); their names travel in the info blob over the
 *    authenticated control channel and the peer fi_av_insert()s them;
 *  - writes are fi_writemsg, with FI_REMOTE_CQ_DATA carrying the immediate, which the target
 *    reads off its CQ (fabric_progress.c) and the core counts as on every transport;
 *  - post() never blocks: a backlog absorbs FI_EAGAIN (fabric_post.c).
 *
 * Who enforces grants: the provider, checking the key, FI_REMOTE_WRITE access and the MR's
 * bounds of every incoming write before it lands (util MR maps in tcp;ofi_rxm and shm, the
 * sockets provider's own; the EFA device checks them in hardware as verbs NICs do). The tests
 * (tests/messenger/test_grants.py) write outside grants on each provider found and check that
 * nothing lands.
 *
 * NOTE: dereg refuses (-EBUSY) while a local write from the region is outstanding; writes INTO
 * a region cannot be seen by the target under one-sided RMA, so the layer above quiesces peers
 * (revoking their grants) before deregistering a destination region.
 */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void fb_destroy(pdkv_transport *t);

static int fb_poll(pdkv_transport *base, pdkv_completion *out, int max)
{
    return pdkv_cq_poll(&((fb_transport *)base)->cq, out, max);
}

static int fb_event_fd(pdkv_transport *base) { return ((fb_transport *)base)->cq.efd; }
static const char *fb_last_error(pdkv_transport *base) { (void)base; return fb_errbuf(); }

static void fb_counters(pdkv_transport *base, pdkv_transport_counters *out)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    out->refused_writes = t->refused_writes;
    pthread_mutex_unlock(&t->mu);
}

/* A "NIC" per device (an EFA device, an interface), for /metrics as verbs' NICs. */
static int fb_nic_stats(pdkv_transport *base, pdkv_nic_stats *out, int max)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    for (uint32_t d = 0; d < t->num_devs && (int)d < max; d++) {
        out[d] = t->dev[d].nic;
        snprintf(out[d].name, sizeof out[d].name, "%s", t->dev[d].name);
        out[d].qps = 0;
        for (uint32_t i = 0; i < t->conns_hi; i++) /* endpoints, verbs' queue pairs */
            out[d].qps += t->conns[i].used && t->conns[i].ep && t->conns[i].dev == d;
    }
    pthread_mutex_unlock(&t->mu);
    return (int)t->num_devs;
}

/* A region's keys on every device name it (FB_ON_DEV): the same index. */
static int fb_same_region(pdkv_transport *base, uint64_t a, uint64_t b)
{
    (void)base;
    return FB_RKEY_INDEX(a) && FB_ON_DEV(a, 0) == FB_ON_DEV(b, 0);
}

static const pdkv_transport_ops fb_ops = {
    .name = "libfabric",
    .reg = fb_reg,
    .grant = fb_grant,
    .revoke = fb_revoke,
    .grant_range = fb_grant_range,
    .revoke_range = fb_revoke_range,
    .dereg = fb_dereg,
    .prepare = fb_prepare,
    .complete = fb_complete,
    .disconnect = fb_disconnect,
    .post = fb_post,
    .poll = fb_poll,
    .event_fd = fb_event_fd,
    .last_error = fb_last_error,
    .counters = fb_counters,
    .destroy = fb_destroy,
    .nic_stats = fb_nic_stats,
    .reg_device = fb_reg_device,
    .nic_key = fb_nic_key,
    .prepare_pairs = fb_prepare_pairs,
    .same_region = fb_same_region,
};

pdkv_transport *pdkv_libfabric_create(uint64_t node_id, const pdkv_libfabric_opts *o, char *err,
                                      size_t errlen)
{
    fb_transport *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, errlen, "libfabric: out of memory");
        return NULL;
    }
    t->base.ops = &fb_ops;
    t->base.node_id = node_id;
    fb_clear_error(); /* a reason left by an earlier call on this thread is not ours */
    pthread_mutex_init(&t->mu, NULL);
    t->conns = calloc(FB_MAX_CONNS, sizeof *t->conns);
    t->regions = calloc(FB_MAX_REGIONS, sizeof *t->regions);
    t->domains = calloc(FB_MAX_DOMAINS, sizeof *t->domains);
    t->links = calloc(FB_MAX_LINKS, sizeof *t->links);
    int rc = !t->conns || !t->regions || !t->domains || !t->links
                 ? fb_fail(-ENOMEM, "libfabric: out of memory") : 0;
    if (!rc)
        rc = pdkv_cq_init(&t->cq) ? fb_fail(-EMFILE, "libfabric: cannot make an eventfd") : 0;
    if (!rc)
        t->cq_ready = 1, rc = fb_open_fabric(t, o);
    if (!rc && !(rc = fb_start_progress(t)))
        return &t->base;
    snprintf(err, errlen, "%s", fb_errbuf());
    fb_destroy(&t->base);
    return NULL;
}

/* Stop the progress thread, close every endpoint (nothing lands or completes after that), then
 * the domains with their MRs, then the fabric. Safe with writes in flight. */
static void fb_destroy(pdkv_transport *base)
{
    fb_transport *t = (fb_transport *)base;
    fb_stop_progress(t);
    pthread_mutex_lock(&t->mu);
    for (uint32_t i = 0; t->links && i < FB_MAX_LINKS; i++)
        if (t->links[i].used)
            fb_drop_link(t, &t->links[i], "transport destroyed");
    for (uint32_t i = 0; t->domains && i < FB_MAX_DOMAINS; i++)
        if (t->domains[i].used)
            fb_domain_free(t, &t->domains[i]);
    pthread_mutex_unlock(&t->mu);
    for (uint32_t d = 0; d < t->num_devs; d++) {
        if (t->dev[d].fabric)
            fi_close(&t->dev[d].fabric->fid);
        if (t->dev[d].info)
            fbl_freeinfo(t->dev[d].info);
    }
    if (t->cq_ready)
        pdkv_cq_destroy(&t->cq);
    pthread_mutex_destroy(&t->mu);
    for (uint32_t i = 0; t->regions && i < t->num_regions; i++)
        if (t->regions[i].key && t->regions[i].dmabuf_fd >= 0)
            close(t->regions[i].dmabuf_fd); /* device memory's dma-buf dup (fb_reg_device) */
    free(t->regions);
    free(t->domains);
    free(t->links);
    free(t->conns);
    free(t);
}
#endif /* PDKV_HAVE_LIBFABRIC */
