/* pdkv verbs transport: RC connections (INIT -> RTR -> RTS) and posting writes.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

vb_qp *vb_find_qp(vb_transport *t, uint32_t qp_num, vb_conn **conn_out)
{
    for (uint32_t i = 0; i < t->conns_hi; i++) {
        vb_conn *c = &t->conns[i];
        for (uint32_t k = 0; c->used && k < t->qps_per_peer; k++)
            if (c->qps[k].qp && c->qps[k].qp->qp_num == qp_num) {
                *conn_out = c;
                return &c->qps[k];
            }
    }
    return NULL;
}

/* Called with t->mu held: every write still outstanding completes with ERROR. */
void vb_drop_conn(vb_transport *t, vb_conn *c, const char *why)
{
    for (uint32_t k = 0; k < t->qps_per_peer; k++) {
        vb_qp *q = &c->qps[k];
        if (!q->qp)
            continue;
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
        ibv_modify_qp(q->qp, &a, IBV_QP_STATE);
        for (; q->count; q->count--, q->head_seq++) {
            vb_pending p = q->ring[q->head_seq % t->sq_depth];
            if (t->regions[p.region].inflight)
                t->regions[p.region].inflight--;
            vb_push_error(t, p.wr_id, c->peer, -ECANCELED, "verbs: write to peer %llu dropped: %s",
                          (unsigned long long)c->peer, why);
        }
        ibv_destroy_qp(q->qp); /* also removes its completions from the CQ */
        free(q->ring);
    }
    vb_flush_backlog(t, c, -ECANCELED, why);
    free(c->backlog);
    vb_domain *d = &t->domains[c->domain];
    if (d->num_conns)
        d->num_conns--;
    memset(c, 0, sizeof *c);
    vb_domain_tidy(t, d); /* a peer with no connection and no grant keeps no PD */
}

/* Called with t->mu held, before `add` more QPs are created. A CQ must hold every completion its
 * QPs and SRQs can have outstanding at once (each QP's send queue, each SRQ's receives), else it
 * overruns and the device fails it: grow it (ibv_resize_cq) or refuse the connection. */
static int size_cq(vb_transport *t, uint32_t add)
{
    uint64_t qps = add, srqs = t->isolate ? 0 : 1;
    for (uint32_t i = 0; i < t->conns_hi; i++)
        qps += t->conns[i].used ? t->qps_per_peer : 0;
    for (uint32_t i = 0; t->isolate && i < VB_MAX_DOMAINS; i++)
        srqs += t->domains[i].used;
    uint64_t need = qps * t->sq_depth + srqs * t->srq_depth;
    if (need <= t->cq_size)
        return 0;
    if (need > t->max_cqe || ibv_resize_cq(t->cq, (int)need)) {
        vb_fail(t, "verbs: the completion queue would need %llu entries for %llu QPs (device limit %u): "
                   "too many connections for one transport", (unsigned long long)need,
                (unsigned long long)qps, t->max_cqe);
        return -ENOSPC;
    }
    t->cq_size = (uint32_t)need;
    return 0;
}

int vb_prepare(pdkv_transport *base, uint64_t peer, void *info_out, uint32_t *info_len,
               uint32_t *conn_out)
{
    vb_transport *t = (vb_transport *)base;
    pthread_mutex_lock(&t->mu);
    if (t->cq_dead) {
        pthread_mutex_unlock(&t->mu);
        vb_fail(t, "verbs: the completion queue failed earlier: this transport can make no new connection");
        return -EIO;
    }
    uint32_t i = 0;
    while (i < VB_MAX_CONNS && t->conns[i].used)
        i++;
    if (i == VB_MAX_CONNS) {
        pthread_mutex_unlock(&t->mu);
        vb_fail(t, "verbs: too many connections (%d)", VB_MAX_CONNS);
        return -EMFILE;
    }
    vb_domain *d = vb_domain_get(t, peer, 1);
    int sized = d ? size_cq(t, t->qps_per_peer) : -ENOMEM;
    if (sized) {
        if (d)
            vb_domain_tidy(t, d);
        pthread_mutex_unlock(&t->mu);
        return sized;
    }
    vb_conn *c = &t->conns[i];
    c->used = 1;
    c->peer = peer;
    c->domain = (uint32_t)(d - t->domains);
    d->num_conns++;
    if (i >= t->conns_hi)
        t->conns_hi = i + 1;
    vb_info info;
    memset(&info, 0, sizeof info);
    info.magic = VB_INFO_MAGIC;
    info.version = VB_INFO_VERSION;
    info.node_id = t->base.node_id;
    memcpy(info.gid, t->gid.raw, 16);
    info.lid = t->lid;
    info.mtu = t->mtu;
    info.link_layer = t->link_layer;
    info.num_qps = t->qps_per_peer;
    for (uint32_t k = 0; k < t->qps_per_peer; k++) {
        vb_qp *q = &c->qps[k];
        struct ibv_qp_init_attr ia = {
            .send_cq = t->cq, .recv_cq = t->cq, .srq = d->srq, .qp_type = IBV_QPT_RC,
            .cap = {.max_send_wr = t->sq_depth, .max_send_sge = 1},
        };
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0,
                                .port_num = t->port_num,
                                .qp_access_flags = IBV_ACCESS_LOCAL_WRITE |
                                                   IBV_ACCESS_REMOTE_WRITE};
        int rc = -1;
        if ((q->ring = calloc(t->sq_depth, sizeof *q->ring)) && (q->qp = ibv_create_qp(d->pd, &ia)))
            rc = ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                              IBV_QP_ACCESS_FLAGS);
        if (rc) {
            vb_fail(t, "verbs: cannot create RC queue pair %u for peer %llu: %s", k,
                    (unsigned long long)peer, strerror(rc > 0 ? rc : errno));
            if (!q->qp) {
                free(q->ring);
                q->ring = NULL;
            }
            vb_drop_conn(t, c, "connection set-up failed");
            pthread_mutex_unlock(&t->mu);
            return -EIO;
        }
        if (getrandom(&q->psn, sizeof q->psn, 0) != sizeof q->psn)
            q->psn = (uint32_t)rand();
        q->psn &= 0xffffff;
        info.qpn[k] = q->qp->qp_num;
        info.psn[k] = q->psn;
    }
    memcpy(info_out, &info, sizeof info);
    *info_len = sizeof info;
    *conn_out = i;
    pthread_mutex_unlock(&t->mu);
    return 0;
}

static int connect_qp(vb_transport *t, vb_qp *q, const vb_info *r, uint32_t k)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)(t->mtu < r->mtu ? t->mtu : r->mtu);
    a.dest_qp_num = r->qpn[k];
    a.rq_psn = r->psn[k];
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 28; /* 163.84 ms: what a writer waits between receiver-not-ready retries */
    a.ah_attr.port_num = t->port_num;
    a.ah_attr.dlid = r->lid;
    if (t->link_layer == IBV_LINK_LAYER_ETHERNET) { /* RoCE routes by GID: a GRH is mandatory */
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, r->gid, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)t->gid_index;
        a.ah_attr.grh.hop_limit = 64;
    }
    int rc = ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                                          IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc)
        return rc;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;   /* 4.096 us * 2^14 = 67 ms per retry */
    a.retry_cnt = 7;
    /* NOTE: 7 would retry receiver-not-ready forever, so a stuck receiver would stall our writes
     * without an error; 6 retries x 164 ms (the peer's min_rnr_timer) end them with
     * IBV_WC_RNR_RETRY_EXC_ERR after about a second (the SRQ refills in microseconds) */
    a.rnr_retry = VB_RNR_RETRY;
    a.sq_psn = q->psn;
    a.max_rd_atomic = 1;
    return ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                        IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

int vb_complete(pdkv_transport *base, uint32_t conn, const void *blob, uint32_t len)
{
    vb_transport *t = (vb_transport *)base;
    vb_info r;
    int rc = 0;
    pthread_mutex_lock(&t->mu);
    vb_conn *c = conn < VB_MAX_CONNS ? &t->conns[conn] : NULL;
    if (len == sizeof r)
        memcpy(&r, blob, sizeof r);
    if (!c || !c->used || c->ready) {
        vb_fail(t, "verbs: complete on connection %u that is not being prepared", conn);
        rc = -ENOENT;
    } else if (len != sizeof r || r.magic != VB_INFO_MAGIC || r.version != VB_INFO_VERSION) {
        vb_fail(t, "verbs: peer connection info is not a pdkv verbs v%d blob (%u bytes)",
                VB_INFO_VERSION, len);
        rc = -EPROTO;
    } else if (r.node_id != c->peer) {
        vb_fail(t, "verbs: connection info comes from node %llu, expected %llu",
                (unsigned long long)r.node_id, (unsigned long long)c->peer);
        rc = -EPROTO;
    } else if (r.num_qps != t->qps_per_peer || r.link_layer != t->link_layer) {
        vb_fail(t, "verbs: peer %llu uses %u QPs on link layer %u, we use %u on %u",
                (unsigned long long)c->peer, r.num_qps, r.link_layer, t->qps_per_peer,
                t->link_layer);
        rc = -EPROTO;
    }
    for (uint32_t k = 0; !rc && k < t->qps_per_peer; k++)
        if ((rc = connect_qp(t, &c->qps[k], &r, k))) {
            vb_fail(t, "verbs: cannot connect queue pair %u to peer %llu: %s", k,
                    (unsigned long long)c->peer, strerror(rc));
            rc = -EIO;
        }
    if (!rc)
        c->ready = 1;
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int vb_disconnect(pdkv_transport *base, uint32_t conn)
{
    vb_transport *t = (vb_transport *)base;
    pthread_mutex_lock(&t->mu);
    int ok = conn < VB_MAX_CONNS && t->conns[conn].used;
    if (ok)
        vb_drop_conn(t, &t->conns[conn], "disconnected");
    pthread_mutex_unlock(&t->mu);
    if (!ok) {
        vb_fail(t, "verbs: disconnect of unknown connection %u", conn);
        return -ENOENT;
    }
    return 0;
}

#endif /* PDKV_HAVE_VERBS */
