/* pdkv libfabric transport: one-sided writes with 32-bit immediates over any libfabric provider
 * with RDM endpoints, FI_RMA and remote CQ data -- AWS EFA ("efa") and, in software,
 * "tcp;ofi_rxm", "sockets" and "shm" (transport.h; the verbs transport is the RC twin).
 *
 * This file holds the function table, creation and teardown, and calls down
 * (fabric_internal.h lists the order).
 *
 * Shape (what fabric-lib and NIXL's libfabric backend do, fitted to pdkv's seam):
 *  - one provider and fabric domain name chosen at create (fi_getinfo, fabric_setup.c);
 *  - a fabric domain per peer, so MR keys -- domain-wide in libfabric -- open nothing to any
 *    other peer (the verbs transport's protection domain per peer); grants are MRs in it;
 *  - an RDM endpoint per connection with its own AV and CQ; its name travels in the info blob
 *    over the authenticated control channel and the peer fi_av_insert()s it;
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

/* One "NIC": the fabric domain (an EFA device, an interface), for /metrics as verbs' NICs. */
static int fb_nic_stats(pdkv_transport *base, pdkv_nic_stats *out, int max)
{
    fb_transport *t = (fb_transport *)base;
    if (max < 1)
        return 1;
    pthread_mutex_lock(&t->mu);
    *out = t->nic;
    snprintf(out->name, sizeof out->name, "%s", t->domain_name);
    out->qps = 0;
    for (uint32_t i = 0; i < t->conns_hi; i++)
        out->qps += t->conns[i].used && t->conns[i].ep; /* endpoints, verbs' queue pairs */
    pthread_mutex_unlock(&t->mu);
    return 1;
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
    int rc = !t->conns || !t->regions || !t->domains ? fb_fail(-ENOMEM, "libfabric: out of memory")
                                                     : 0;
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
    for (uint32_t i = 0; t->conns && i < t->conns_hi; i++)
        if (t->conns[i].used)
            fb_drop_conn(t, &t->conns[i], "transport destroyed");
    for (uint32_t i = 0; t->domains && i < FB_MAX_DOMAINS; i++)
        if (t->domains[i].used)
            fb_domain_free(t, &t->domains[i]);
    pthread_mutex_unlock(&t->mu);
    if (t->fabric)
        fi_close(&t->fabric->fid);
    if (t->info)
        fbl_freeinfo(t->info);
    if (t->cq_ready)
        pdkv_cq_destroy(&t->cq);
    pthread_mutex_destroy(&t->mu);
    for (uint32_t i = 0; t->regions && i < t->num_regions; i++)
        if (t->regions[i].key && t->regions[i].dmabuf_fd >= 0)
            close(t->regions[i].dmabuf_fd); /* device memory's dma-buf dup (fb_reg_device) */
    free(t->regions);
    free(t->domains);
    free(t->conns);
    free(t);
}
#endif /* PDKV_HAVE_LIBFABRIC */
