/* Loopback verbs device: the requester side of RC WRITE / WRITE_WITH_IMM.
 *
 * Like a NIC, ibv_post_send never blocks: it checks the WRs, records them as outstanding, pins
 * their local MRs and queues a frame for the QP's sender thread, which streams it to the target
 * process. The QP's ack thread matches acks to outstanding WRs (in order, as RC completes):
 * success completes signaled WRs, a NAK completes the WR with its status and flushes the rest,
 * and a broken stream (the target process died) is "transport retry exceeded". */
#include "lv_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

static void push_send_wc(struct lv_qp *q, const struct lv_wr *w, enum ibv_wc_status st)
{
    struct ibv_wc wc;
    memset(&wc, 0, sizeof wc);
    wc.wr_id = w->wr_id;
    wc.status = st;
    wc.opcode = IBV_WC_RDMA_WRITE;
    wc.byte_len = (uint32_t)w->len;
    wc.qp_num = q->qp.qp_num;
    lv_cq_push((struct lv_cq *)q->qp.send_cq, &wc);
}

/* Called with g_mu held. The head WR completes with `first`, every other outstanding WR is
 * flushed (errors always produce a completion, signaled or not), and the QP enters ERR. */
void lv_qp_fail(struct lv_qp *q, enum ibv_wc_status first)
{
    int signaled_only = lv_fault("flush_signaled_only") > 0;
    for (int i = 0; i < q->out_count; i++) {
        const struct lv_wr *w = &q->out[(q->out_head + i) % q->max_send_wr];
        if (w->signaled || !signaled_only || (i == 0 && first != IBV_WC_WR_FLUSH_ERR))
            push_send_wc(q, w, i == 0 ? first : IBV_WC_WR_FLUSH_ERR);
    }
    q->out_head = q->out_count = 0;
    q->err_pending = 0;
    q->qp.state = IBV_QPS_ERR;
}

/* Called with g_mu held: a WR that failed locally fails the QP once every WR before it is done. */
static void drain_local_errors(struct lv_qp *q)
{
    if (q->out_count && q->out[q->out_head].status)
        lv_qp_fail(q, q->out[q->out_head].status);
}

static void *ack_main(void *arg)
{
    struct lv_qp *q = arg;
    struct lv_ack a;
    while (!lv_read_full(q->sock, &a, sizeof a)) {
        pthread_mutex_lock(&g_mu);
        if (q->out_count && q->out[q->out_head].seq == a.seq) {
            struct lv_wr w = q->out[q->out_head];
            q->out_head = (q->out_head + 1) % q->max_send_wr;
            q->out_count--;
            if (a.status != IBV_WC_SUCCESS) {
                push_send_wc(q, &w, a.status);
                lv_qp_fail(q, IBV_WC_WR_FLUSH_ERR);
            } else if (w.signaled) {
                push_send_wc(q, &w, IBV_WC_SUCCESS);
            }
            drain_local_errors(q);
        }
        pthread_mutex_unlock(&g_mu);
    }
    /* The target is gone (or we are being destroyed): what was in flight never got acked. */
    pthread_mutex_lock(&g_mu);
    q->peer_dead = 1;
    if (!q->destroying && q->out_count)
        lv_qp_fail(q, IBV_WC_RETRY_EXC_ERR);
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

static int send_job(int fd, struct lv_job *j)
{
    struct lv_frame f = {j->seq, j->wr.wr.rdma.remote_addr, 0, j->wr.wr.rdma.rkey,
                         j->wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM, j->wr.imm_data, 0};
    struct iovec iov[17];
    iov[0].iov_base = &f;
    iov[0].iov_len = sizeof f;
    for (int i = 0; i < j->wr.num_sge; i++) {
        struct lv_mr *m = j->mrs[i];
        iov[i + 1].iov_base = (char *)m->mr.addr + (j->sg[i].addr - m->iova);
        iov[i + 1].iov_len = j->sg[i].length;
        f.len += j->sg[i].length;
    }
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)j->wr.num_sge + 1};
    while (msg.msg_iovlen) {
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        while (msg.msg_iovlen && (size_t)n >= msg.msg_iov->iov_len) {
            n -= (ssize_t)msg.msg_iov->iov_len;
            msg.msg_iov++;
            msg.msg_iovlen--;
        }
        if (msg.msg_iovlen) {
            msg.msg_iov->iov_base = (char *)msg.msg_iov->iov_base + n;
            msg.msg_iov->iov_len -= (size_t)n;
        }
    }
    return 0;
}

static void *tx_main(void *arg)
{
    struct lv_qp *q = arg;
    int broken = 0;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        while (!q->jobs && !q->destroying)
            pthread_cond_wait(&q->jobs_cond, &g_mu);
        struct lv_job *j = q->jobs;
        if (!j)
            break; /* destroying, and nothing left to unpin */
        q->jobs = j->next;
        if (!q->jobs)
            q->jobs_tail = NULL;
        int skip = broken || q->destroying;
        pthread_mutex_unlock(&g_mu);
        if (!skip && send_job(q->sock, j)) {
            broken = 1;
            shutdown(q->sock, SHUT_RDWR); /* the ack reader sees EOF and fails what is left */
        }
        pthread_mutex_lock(&g_mu);
        if (!skip && !broken) {
            uint64_t len = 0;
            for (int i = 0; i < j->wr.num_sge; i++)
                len += j->sg[i].length;
            lv_count(q->qp.context->device, 0, len);
        }
        for (int i = 0; i < j->wr.num_sge; i++)
            j->mrs[i]->busy--;
        pthread_cond_broadcast(&g_cond);
        free(j);
    }
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

int lv_start_requester(struct lv_qp *q)
{
    pthread_cond_init(&q->jobs_cond, NULL);
    if (pthread_create(&q->ack_thread, NULL, ack_main, q))
        return -1;
    if (pthread_create(&q->tx_thread, NULL, tx_main, q)) {
        shutdown(q->sock, SHUT_RDWR);
        pthread_join(q->ack_thread, NULL);
        return -1;
    }
    q->threads_started = 1;
    return 0;
}

/* q->destroying is set: wake the sender (it unpins what is queued), break a blocked send. */
void lv_stop_requester(struct lv_qp *q)
{
    if (!q->threads_started)
        return;
    pthread_mutex_lock(&g_mu);
    pthread_cond_broadcast(&q->jobs_cond);
    pthread_mutex_unlock(&g_mu);
    shutdown(q->sock, SHUT_RDWR);
    pthread_join(q->tx_thread, NULL);
    pthread_join(q->ack_thread, NULL);
    pthread_cond_destroy(&q->jobs_cond);
}

/* Called with g_mu held: checks one gather entry against the QP's PD and pins its MR. */
static struct lv_mr *pin_local(struct lv_qp *q, const struct ibv_sge *s)
{
    struct lv_mr *m = lv_find_mr_lkey(s->lkey);
    if (!m || m->mr.pd != q->qp.pd || s->addr < m->iova || s->length > m->mr.length ||
        s->addr - m->iova > m->mr.length - s->length)
        return NULL;
    m->busy++;
    return m;
}

/* Called with g_mu held: one accepted WR; errors surface as completions, not return codes. */
static void start_wr(struct lv_qp *q, struct ibv_send_wr *w, struct lv_wr *o)
{
    if (q->qp.state == IBV_QPS_ERR) { /* posting to an errored QP flushes the request */
        lv_qp_fail(q, IBV_WC_WR_FLUSH_ERR);
        return;
    }
    if (q->err_pending) { /* behind a locally failed WR: never sent, flushed with it */
        o->status = IBV_WC_WR_FLUSH_ERR;
        return;
    }
    if (q->peer_dead) {
        lv_qp_fail(q, IBV_WC_RETRY_EXC_ERR);
        return;
    }
    struct lv_job *j = calloc(1, sizeof *j);
    int pinned = 0;
    while (j && pinned < w->num_sge && (j->mrs[pinned] = pin_local(q, &w->sg_list[pinned])))
        pinned++;
    if (!j || pinned < w->num_sge) { /* a bad lkey/bounds is a local protection error */
        for (int i = 0; i < pinned; i++)
            j->mrs[i]->busy--;
        free(j);
        o->status = IBV_WC_LOC_PROT_ERR;
        q->err_pending = 1;
        drain_local_errors(q);
        return;
    }
    j->seq = o->seq;
    j->wr = *w;
    memcpy(j->sg, w->sg_list, (size_t)w->num_sge * sizeof *j->sg);
    j->wr.sg_list = j->sg;
    j->wr.next = NULL;
    if (q->jobs_tail)
        q->jobs_tail->next = j;
    else
        q->jobs = j;
    q->jobs_tail = j;
    pthread_cond_signal(&q->jobs_cond);
}

int lv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    struct lv_qp *q = (struct lv_qp *)qp;
    int rc = 0;
    pthread_mutex_lock(&g_mu);
    for (struct ibv_send_wr *w = wr; w; w = w->next) {
        if ((qp->state != IBV_QPS_RTS && qp->state != IBV_QPS_ERR) ||
            (w->opcode != IBV_WR_RDMA_WRITE && w->opcode != IBV_WR_RDMA_WRITE_WITH_IMM) ||
            w->num_sge < 0 || w->num_sge > 16)
            rc = EINVAL;
        else if (q->out_count == q->max_send_wr)
            rc = ENOMEM; /* send queue full: the caller signals too rarely or posts too much */
        if (rc) {
            *bad = w;
            break;
        }
        struct lv_wr *o = &q->out[(q->out_head + q->out_count++) % q->max_send_wr];
        o->seq = q->next_seq++;
        o->wr_id = w->wr_id;
        o->opcode = w->opcode;
        o->signaled = q->sq_sig_all || (w->send_flags & IBV_SEND_SIGNALED);
        o->status = 0;
        o->len = 0;
        for (int i = 0; i < w->num_sge; i++)
            o->len += w->sg_list[i].length;
        start_wr(q, w, o);
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}
