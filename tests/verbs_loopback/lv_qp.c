/* Loopback verbs device: RC queue pairs (creation, the INIT -> RTR -> RTS rules, destruction)
 * and their receive queues. The requester data path is in lv_send.c, the responder side
 * (placing payloads, consuming receives) in lv_wire.c. */
#include "lv_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static struct lv_qp *g_qps;
static uint32_t g_next_qpn = 0x11;

struct lv_qp *lv_find_qp(uint32_t qpn)
{
    for (struct lv_qp *q = g_qps; q; q = q->next)
        if (q->qp.qp_num == qpn)
            return q;
    return NULL;
}

long lv_num_qps(struct ibv_device *dev)
{
    long n = 0;
    for (struct lv_qp *q = g_qps; q; q = q->next)
        n += q->qp.context->device == dev;
    return n;
}

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *a)
{
    if (a->qp_type != IBV_QPT_RC || !a->send_cq || !a->recv_cq || a->cap.max_send_wr == 0 ||
        a->cap.max_send_wr > 16384 || a->cap.max_send_sge > 16) {
        errno = EINVAL;
        return NULL;
    }
    if (a->srq && a->srq->pd != pd) { /* a QP and its SRQ share one protection domain */
        errno = EINVAL;
        return NULL;
    }
    struct lv_qp *q = calloc(1, sizeof *q);
    if (q)
        q->out = calloc(a->cap.max_send_wr, sizeof *q->out);
    if (!q || !q->out) {
        free(q);
        errno = ENOMEM;
        return NULL;
    }
    q->qp.context = pd->context;
    q->qp.qp_context = a->qp_context;
    q->qp.pd = pd;
    q->qp.send_cq = a->send_cq;
    q->qp.recv_cq = a->recv_cq;
    q->qp.srq = a->srq;
    q->qp.state = IBV_QPS_RESET;
    q->qp.qp_type = IBV_QPT_RC;
    q->max_send_wr = (int)a->cap.max_send_wr;
    q->sock = -1;
    q->rq.cap = 0;
    q->sq_sig_all = a->sq_sig_all;
    q->max_recv_wr = (int)a->cap.max_recv_wr;
    pthread_mutex_lock(&g_mu);
    q->qp.qp_num = g_next_qpn++;
    q->next = g_qps;
    g_qps = q;
    pthread_mutex_unlock(&g_mu);
    return &q->qp;
}

static int to_rts(struct lv_qp *q)
{
    int fd = q->is_global ? lv_connect_gid(&q->dgid) : lv_connect_lid(q->dlid);
    if (fd >= 0) {
        struct lv_hello h = {LV_MAGIC, q->dest_qpn, q->qp.qp_num, 0};
        if (lv_write_full(fd, &h, sizeof h)) {
            close(fd);
            fd = -1;
        }
    }
    pthread_mutex_lock(&g_mu);
    q->sock = fd;
    q->peer_dead = fd < 0; /* like real RC: modify succeeds, sends fail with retry exceeded */
    q->qp.state = IBV_QPS_RTS;
    pthread_mutex_unlock(&g_mu);
    if (fd >= 0 && lv_start_requester(q)) {
        pthread_mutex_lock(&g_mu);
        q->peer_dead = 1;
        pthread_mutex_unlock(&g_mu);
    }
    return 0;
}

#define NEED(m) (((mask) & (m)) == (m))

int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
    struct lv_qp *q = (struct lv_qp *)qp;
    if (!(mask & IBV_QP_STATE))
        return EINVAL;
    enum ibv_qp_state cur = qp->state, to = attr->qp_state;
    if (to == IBV_QPS_ERR) {
        pthread_mutex_lock(&g_mu);
        lv_qp_fail(q, IBV_WC_WR_FLUSH_ERR);
        pthread_mutex_unlock(&g_mu);
        return 0;
    }
    if ((cur == IBV_QPS_RESET || cur == IBV_QPS_INIT) && to == IBV_QPS_INIT) {
        if (cur == IBV_QPS_RESET &&
            !NEED(IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
            return EINVAL;
        if ((mask & IBV_QP_PORT) && attr->port_num != 1)
            return EINVAL;
        if (mask & IBV_QP_ACCESS_FLAGS)
            q->access = (int)attr->qp_access_flags;
        qp->state = IBV_QPS_INIT;
        return 0;
    }
    if (cur == IBV_QPS_INIT && to == IBV_QPS_RTR) {
        if (!NEED(IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
            return EINVAL;
        /* RoCE routes by GID: an address vector without a GRH cannot be routed. IB routes by
         * LID (a GRH is optional there and unused by this device). */
        const struct ibv_ah_attr *ah = &attr->ah_attr;
        if ((lv_link_is_ib() ? !ah->dlid : !ah->is_global) ||
            ah->port_num != 1 || attr->path_mtu < IBV_MTU_256 || attr->path_mtu > IBV_MTU_4096)
            return EINVAL;
        q->is_global = !lv_link_is_ib();
        q->dlid = ah->dlid;
        q->dgid = ah->grh.dgid;
        q->dest_qpn = attr->dest_qp_num;
        qp->state = IBV_QPS_RTR;
        return 0;
    }
    if (cur == IBV_QPS_RTR && to == IBV_QPS_RTS) {
        if (!NEED(IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                  IBV_QP_MAX_QP_RD_ATOMIC))
            return EINVAL;
        return to_rts(q);
    }
    return EINVAL; /* other transitions are not used by pdkv and not modelled */
}

int ibv_destroy_qp(struct ibv_qp *qp)
{
    struct lv_qp *q = (struct lv_qp *)qp;
    pthread_mutex_lock(&g_mu);
    for (struct lv_qp **p = &g_qps; *p; p = &(*p)->next)
        if (*p == q) {
            *p = q->next;
            break;
        }
    q->destroying = 1;
    pthread_mutex_unlock(&g_mu);
    lv_stop_requester(q); /* joins its sender and ack threads, unpins queued frames */
    if (q->sock >= 0)
        close(q->sock);
    pthread_mutex_lock(&g_mu);
    lv_cq_purge_qp((struct lv_cq *)qp->send_cq, qp->qp_num);
    lv_cq_purge_qp((struct lv_cq *)qp->recv_cq, qp->qp_num);
    lv_async_purge_qp(qp->context, qp);
    pthread_mutex_unlock(&g_mu);
    free(q->rq.ids);
    free(q->out);
    free(q);
    return 0;
}

int lv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    struct lv_qp *q = (struct lv_qp *)qp;
    int rc = 0;
    pthread_mutex_lock(&g_mu);
    for (; wr; wr = wr->next)
        if (qp->srq || (rc = lv_rq_push(&q->rq, wr->wr_id, q->max_recv_wr))) {
            rc = rc ? rc : EINVAL;
            *bad = wr;
            break;
        }
    pthread_cond_broadcast(&g_cond);
    pthread_mutex_unlock(&g_mu);
    return rc;
}
