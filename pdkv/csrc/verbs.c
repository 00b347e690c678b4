/* pdkv verbs transport: RDMA WRITE / WRITE_WITH_IMM over ibverbs RC queue pairs (transport.h).
 *
 * This file holds the function table, creation and teardown, and calls down (verbs_internal.h).
 *
 * Shape (what an engineer who knows NIXL / Mooncake / fabric-lib expects):
 *  - one NIC (chosen by name), one PD, one CQ for sends and receives, one completion channel;
 *  - qps_per_peer RC QPs per connection; a batch is spread round-robin over them;
 *  - one SRQ kept full of zero-length receives, reposted as they are consumed, so a
 *    WRITE_WITH_IMM never meets receiver-not-ready (rnr_retry is bounded: a receiver stuck for
 *    about a second fails the writes with an error instead of stalling them forever);
 *  - one CQ sized to the QPs and SRQs it serves (grown as connections are added); a poll error
 *    or IBV_EVENT_CQ_ERR fails every connection at once (verbs_progress.c);
 *  - post() never blocks: writes enter a per-connection backlog that is moved onto the send
 *    queues as they have room (verbs_post.c);
 *  - a WR is signaled every VB_SIGNAL_EVERY posts and at the end of each post call; RC completes
 *    in order, so a signaled completion retires every earlier unsignaled WR of its QP. Each
 *    QP keeps a ring of posted WRs (ibv wr_id = sequence number) to report every pdkv write;
 *  - a progress thread drains the CQ (spin briefly, then arm the channel and sleep in poll(2)),
 *    turns work completions into pdkv completions in a queue and signals an eventfd; it also
 *    reads async events (a peer's bad write breaks our QP: QP_ACCESS_ERR) and reports them.
 *
 * Keys: regions are registered with iova = the address's offset within its page (sysconf), so a
 * peer addresses a region from 0 without knowing our virtual address (the page offset is kept
 * so providers that require iova and address to share it accept the MR). A key is
 *   [63:48] region index + 1 | [47:32] page offset | [31:0] rkey
 * and a write to (key, roff) goes to remote address pgoff + roff with rkey. The NIC checks rkey,
 * PD, access and bounds; nothing is ever written outside the registered region.
 *
 * Grants (verbs_mr.c): with isolate_peers each peer has its own protection domain and a grant
 * is a registration in it, so the NIC enforces who may write where (and for how long).
 *
 * NOTE: dereg refuses (-EBUSY) while a local write from the region is outstanding. Writes INTO a
 * region cannot be seen by the target under one-sided RDMA; the layer above must quiesce peers
 * (the messenger's leases) before deregistering a destination region.
 */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_multi.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

static void vb_destroy(pdkv_transport *t);

static int vb_poll(pdkv_transport *base, pdkv_completion *out, int max)
{
    vb_transport *t = (vb_transport *)base;
    int n = 0;
    pthread_mutex_lock(&t->mu);
    while (n < max && t->cq_count) {
        out[n++] = t->cq_ring[t->cq_head];
        t->cq_head = (t->cq_head + 1) % t->cq_cap;
        t->cq_count--;
    }
    if (!t->cq_count && !t->efd_shared) { /* readable exactly while something is queued */
        uint64_t v;
        if (read(t->efd, &v, sizeof v) < 0) {
            /* EAGAIN: already drained */
        }
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

static void vb_counters(pdkv_transport *base, pdkv_transport_counters *out)
{
    vb_transport *t = (vb_transport *)base;
    pthread_mutex_lock(&t->mu);
    out->refused_writes = t->refused_writes;
    pthread_mutex_unlock(&t->mu);
}

static int vb_event_fd(pdkv_transport *base) { return ((vb_transport *)base)->efd; }
static const char *vb_last_error(pdkv_transport *base) { (void)base; return vb_errbuf(); }

static const pdkv_transport_ops vb_ops = {
    .name = "verbs",
    .reg = vb_reg,
    .grant = vb_grant,
    .revoke = vb_revoke,
    .grant_range = vb_grant_range,
    .revoke_range = vb_revoke_range,
    .dereg = vb_dereg,
    .prepare = vb_prepare,
    .complete = vb_complete,
    .disconnect = vb_disconnect,
    .post = vb_post,
    .poll = vb_poll,
    .event_fd = vb_event_fd,
    .last_error = vb_last_error,
    .counters = vb_counters,
    .destroy = vb_destroy,
    .reg_device = vb_reg_device,
};

pdkv_transport *pdkv_verbs_create(uint64_t node_id, const pdkv_verbs_opts *o, char *err,
                                  size_t errlen)
{
    return vb_create_shared(node_id, o, -1, err, errlen);
}

pdkv_transport *vb_create_shared(uint64_t node_id, const pdkv_verbs_opts *o, int shared_efd,
                                 char *err, size_t errlen)
{
    vb_transport *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, errlen, "verbs: out of memory");
        return NULL;
    }
    t->base.ops = &vb_ops;
    t->base.node_id = node_id;
    t->efd = t->wake_fd = -1;
    if (shared_efd >= 0)
        t->efd = shared_efd, t->efd_shared = 1;
    vb_clear_error(); /* a reason left by an earlier call on this thread is not ours */
    t->port_num = o && o->port_num ? o->port_num : 1;
    t->qps_per_peer = o && o->qps_per_peer ? o->qps_per_peer : 1;
    t->isolate = o && o->isolate_peers;
    long page = sysconf(_SC_PAGESIZE);
    t->page_size = page > 0 ? (uint64_t)page : 4096;
    pthread_mutex_init(&t->mu, NULL);
    t->conns = calloc(VB_MAX_CONNS, sizeof *t->conns);
    t->regions = calloc(VB_MAX_REGIONS, sizeof *t->regions);
    t->domains = calloc(VB_MAX_DOMAINS, sizeof *t->domains);
    int n = 0;
    while (o && o->nics && o->nics[n])
        n++;
    if (!t->conns || !t->regions || !t->domains)
        vb_fail(t, "verbs: out of memory");
    else if (t->page_size > VB_MAX_PGOFF || (t->page_size & (t->page_size - 1)))
        vb_fail(t, "verbs: page size %llu is not a power of two up to 64 KiB (keys keep 16 bits of page offset)",
                (unsigned long long)t->page_size);
    else if (n != 1)
        vb_fail(t, "verbs: a single-NIC transport takes exactly one NIC name, got %d (several: "
                   "pdkv_verbs_multi_create)", n);
    else if (!strcmp(o->nics[0], "auto") || !o->nics[0][0])
        vb_fail(t, "verbs: NIC '%s' must be resolved to a device name before the transport "
                   "is created", o->nics[0]);
    else if (t->qps_per_peer > VB_MAX_QPS)
        vb_fail(t, "verbs: qps_per_peer must be 1..%d, got %u", VB_MAX_QPS, t->qps_per_peer);
    if (!vb_errbuf()[0] && !vb_open_device(t, o)) {
        if (!t->isolate) /* shared mode: every peer's QPs live in t->pd, on t->srq */
            t->domains[0] = (vb_domain){.used = 1, .pd = t->pd, .srq = t->srq};
        if (!vb_start_progress(t))
            return &t->base;
    }
    snprintf(err, errlen, "%s", vb_errbuf());
    vb_destroy(&t->base);
    return NULL;
}

/* Stop the progress thread first, then break every QP (nothing can land or complete after
 * ibv_destroy_qp), then free in dependency order. Safe with writes in flight. */
static void vb_destroy(pdkv_transport *base)
{
    vb_transport *t = (vb_transport *)base;
    vb_stop_progress(t);
    pthread_mutex_lock(&t->mu);
    for (uint32_t i = 0; t->conns && i < VB_MAX_CONNS; i++)
        if (t->conns[i].used)
            vb_drop_conn(t, &t->conns[i], "transport destroyed");
    for (uint32_t i = 0; t->isolate && t->domains && i < VB_MAX_DOMAINS; i++)
        if (t->domains[i].used)
            vb_domain_free(t, &t->domains[i]); /* grants and local MRs, SRQ, PD */
    for (uint32_t i = 0; t->regions && i < t->num_regions; i++)
        if (t->regions[i].mr || t->regions[i].dying) { /* dying: its own MR is gone already */
            if (t->regions[i].mr)
                ibv_dereg_mr(t->regions[i].mr);
            if (t->regions[i].dmabuf)
                close(t->regions[i].dmabuf_fd);
        }
    pthread_mutex_unlock(&t->mu);
    if (t->srq)
        ibv_destroy_srq(t->srq);
    if (t->cq)
        ibv_destroy_cq(t->cq);
    if (t->channel)
        ibv_destroy_comp_channel(t->channel);
    if (t->pd)
        ibv_dealloc_pd(t->pd);
    if (t->ctx)
        ibv_close_device(t->ctx);
    if (t->efd >= 0 && !t->efd_shared)
        close(t->efd);
    if (t->wake_fd >= 0)
        close(t->wake_fd);
    pthread_mutex_destroy(&t->mu);
    free(t->regions);
    free(t->domains);
    free(t->conns);
    free(t->cq_ring);
    free(t);
}
#endif /* PDKV_HAVE_VERBS */
