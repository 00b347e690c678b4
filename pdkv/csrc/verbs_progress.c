/* pdkv verbs transport: the progress thread. It drains the CQ (spin briefly, then arm the
 * channel and sleep in poll(2)), turns work completions into pdkv completions and reads async
 * events. Calls down into verbs_conn.c (QP lookup), verbs_post.c (pump the backlog),
 * verbs_setup.c (repost receives) and verbs_report.c.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

static int wc_errno(enum ibv_wc_status st)
{
    switch (st) {
    case IBV_WC_REM_ACCESS_ERR: return -EACCES;   /* bad key, bounds or permission at the peer */
    case IBV_WC_LOC_PROT_ERR: return -EFAULT;
    case IBV_WC_RETRY_EXC_ERR: return -ECONNRESET; /* the peer stopped answering */
    case IBV_WC_RNR_RETRY_EXC_ERR: return -ETIMEDOUT; /* the peer posted no receive for ~1 s */
    case IBV_WC_WR_FLUSH_ERR: return -ECANCELED;   /* an earlier error broke the QP */
    default: return -EIO;
    }
}

/* Called with t->mu held: a send completion retires every earlier WR of its QP (RC order).
 * A success or a first real error (say a remote access error at WR k) means every earlier WR
 * landed. A flush error says nothing about the unsignaled WRs before it (a provider may flush
 * only signaled WRs, one completion for a run), so they are failures. After any error the QP is
 * in ERR: what it still holds is failed at once, not awaited (see vb_fail_outstanding). */
static void on_send_wc(vb_transport *t, const struct ibv_wc *wc)
{
    vb_conn *c;
    vb_qp *q = vb_find_qp(t, wc->qp_num, &c);
    if (!q)
        return; /* the connection was dropped and its writes already reported */
    int flushed = wc->status == IBV_WC_WR_FLUSH_ERR;
    while (q->count && q->head_seq <= wc->wr_id) {
        uint64_t seq = q->head_seq++;
        vb_pending p = q->ring[seq % t->sq_depth];
        q->count--;
        if (t->regions[p.region].inflight)
            t->regions[p.region].inflight--;
        if (wc->status == IBV_WC_SUCCESS || (seq < wc->wr_id && !flushed)) {
            pdkv_completion done;
            memset(&done, 0, sizeof done);
            done.kind = PDKV_CQ_WRITE_DONE;
            done.wr_id = p.wr_id;
            done.peer = c->peer;
            done.len = p.len;
            vb_push(t, &done);
        } else {
            c->broken = 1;
            vb_push_error(t, p.wr_id, c->peer, wc_errno(wc->status),
                          "verbs: write to peer %llu failed: %s (status %d)%s",
                          (unsigned long long)c->peer, ibv_wc_status_str(wc->status),
                          (int)wc->status,
                          wc->status == IBV_WC_RNR_RETRY_EXC_ERR
                              ? ": the peer posted no receive (stalled or gone)" : "");
        }
    }
    if (wc->status != IBV_WC_SUCCESS) {
        c->broken = 1;
        vb_fail_outstanding(t, c, q, -ECANCELED, "flushed after an earlier error on the connection");
    }
    vb_pump(t, c); /* room on the send queue: move backlog writes (or fail them if broken) */
}

/* Called with t->mu held. The CQ failed (poll error or IBV_EVENT_CQ_ERR): no completion of any
 * connection on it can be trusted or will arrive, so every connection fails now, loudly. */
static void cq_failed(vb_transport *t, const char *why)
{
    if (t->cq_dead)
        return;
    t->cq_dead = 1;
    for (uint32_t i = 0; i < t->conns_hi; i++) {
        vb_conn *c = &t->conns[i];
        if (!c->used)
            continue;
        c->broken = 1;
        for (uint32_t k = 0; k < t->qps_per_peer; k++)
            vb_fail_outstanding(t, c, &c->qps[k], -EIO, why);
        vb_flush_backlog(t, c, -EIO, why);
        vb_push_error(t, 0, c->peer, -EIO, "verbs: connection to peer %llu failed: %s",
                      (unsigned long long)c->peer, why);
    }
    vb_push_error(t, 0, 0, -EIO, "verbs: %s; this transport can make no new connection", why);
}

static void on_recv_wc(vb_transport *t, const struct ibv_wc *wc)
{
    vb_conn *c;
    uint64_t peer = vb_find_qp(t, wc->qp_num, &c) ? c->peer : 0;
    if (wc->status != IBV_WC_SUCCESS) {
        if (wc->status != IBV_WC_WR_FLUSH_ERR)
            vb_push_error(t, 0, peer, wc_errno(wc->status), "verbs: receive failed: %s",
                          ibv_wc_status_str(wc->status));
        return;
    }
    if (!(wc->wc_flags & IBV_WC_WITH_IMM))
        return;
    pdkv_completion imm;
    memset(&imm, 0, sizeof imm);
    imm.kind = PDKV_CQ_IMM;
    imm.imm = ntohl(wc->imm_data);
    imm.peer = peer;
    imm.len = wc->byte_len;
    vb_push(t, &imm);
}

static void on_async_event(vb_transport *t)
{
    struct ibv_async_event ev;
    if (ibv_get_async_event(t->ctx, &ev))
        return;
    pthread_mutex_lock(&t->mu);
    if (ev.event_type == IBV_EVENT_QP_FATAL || ev.event_type == IBV_EVENT_QP_REQ_ERR ||
        ev.event_type == IBV_EVENT_QP_ACCESS_ERR) {
        vb_conn *c;
        if (ev.event_type == IBV_EVENT_QP_ACCESS_ERR)
            t->refused_writes++; /* the NIC refused a peer's write into our memory */
        if (vb_find_qp(t, ev.element.qp->qp_num, &c)) {
            c->broken = 1;
            vb_flush_backlog(t, c, -ECONNRESET, "the connection broke");
            vb_push_error(t, 0, c->peer, ev.event_type == IBV_EVENT_QP_ACCESS_ERR ? -EACCES : -EIO,
                          "verbs: connection to peer %llu broken: %s",
                          (unsigned long long)c->peer,
                          ev.event_type == IBV_EVENT_QP_ACCESS_ERR
                              ? "the peer wrote with a bad key, address or permission"
                              : "queue pair error");
        }
        if (vb_find_qp(t, ev.element.qp->qp_num, &c))
            for (uint32_t k = 0; k < t->qps_per_peer; k++) /* a provider may flush nothing */
                vb_fail_outstanding(t, c, &c->qps[k], -ECONNRESET, "the connection broke");
    } else if (ev.event_type == IBV_EVENT_CQ_ERR) {
        cq_failed(t, "the completion queue failed (IBV_EVENT_CQ_ERR: overrun?)");
    } else if (ev.event_type == IBV_EVENT_PORT_ERR || ev.event_type == IBV_EVENT_DEVICE_FATAL) {
        vb_push_error(t, 0, 0, -ENETDOWN, "verbs: %s on NIC %s",
                      ev.event_type == IBV_EVENT_PORT_ERR ? "port went down" : "device fatal error",
                      ibv_get_device_name(t->ctx->device));
    }
    pthread_mutex_unlock(&t->mu);
    ibv_ack_async_event(&ev);
}

/* Handles one batch of work completions; returns how many there were. */
static int drain_cq(vb_transport *t)
{
    struct ibv_wc wcs[64];
    if (__atomic_load_n(&t->cq_dead, __ATOMIC_ACQUIRE))
        return 0;
    int n = ibv_poll_cq(t->cq, 64, wcs);
    if (n < 0) { /* not "idle": the CQ is broken and nothing on it will complete */
        char why[96];
        snprintf(why, sizeof why, "ibv_poll_cq failed (%d)", n);
        pthread_mutex_lock(&t->mu);
        cq_failed(t, why);
        pthread_mutex_unlock(&t->mu);
        return 0;
    }
    if (n == 0)
        return 0;
    /* Repost consumed receives first, on the SRQ of the QP's domain (isolate_peers: one per
     * peer), grouped so a burst costs one post per SRQ. */
    struct ibv_srq *srqs[64];
    int counts[64], num_srqs = 0, failed = 0;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < n; i++) {
        if (wcs[i].wr_id != VB_RECV_ID)
            continue;
        vb_conn *c;
        struct ibv_srq *srq = !t->isolate ? t->srq
                              : vb_find_qp(t, wcs[i].qp_num, &c) ? t->domains[c->domain].srq : NULL;
        int k = 0;
        while (k < num_srqs && srqs[k] != srq)
            k++;
        if (k == num_srqs)
            srqs[num_srqs] = srq, counts[num_srqs++] = 0;
        counts[k]++;
    }
    for (int k = 0; k < num_srqs; k++)
        if (srqs[k] && vb_post_recvs(srqs[k], counts[k])) /* immediates will meet RNR: say so */
            failed += counts[k];
    if (failed)
        vb_push_error(t, 0, 0, -EIO, "verbs: cannot repost %d receives on the SRQ", failed);
    for (int i = 0; i < n; i++) {
        if (wcs[i].wr_id == VB_RECV_ID) /* opcode is undefined on error: tell by wr_id */
            on_recv_wc(t, &wcs[i]);
        else
            on_send_wc(t, &wcs[i]);
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

static void *progress_main(void *arg)
{
    vb_transport *t = arg;
    struct pollfd pf[3] = {{t->channel->fd, POLLIN, 0}, {t->ctx->async_fd, POLLIN, 0},
                           {t->wake_fd, POLLIN, 0}};
    uint64_t batches = 0;
    while (!__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE)) {
        /* Spin a little while completions flow; then arm and sleep so an idle node costs 0.
         * Under steady traffic, look at async events every so often without sleeping. */
        int idle = 0;
        while (idle < VB_SPIN_POLLS && !__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE)) {
            idle = drain_cq(t) > 0 ? 0 : idle + 1;
            if (!idle && ++batches % 256 == 0 && poll(&pf[1], 1, 0) == 1)
                on_async_event(t);
        }
        if (!__atomic_load_n(&t->cq_dead, __ATOMIC_ACQUIRE) && ibv_req_notify_cq(t->cq, 0)) {
            pthread_mutex_lock(&t->mu);
            vb_push_error(t, 0, 0, -EIO, "verbs: ibv_req_notify_cq failed");
            pthread_mutex_unlock(&t->mu);
        }
        if (drain_cq(t) > 0) /* a completion that raced the arming */
            continue;
        if (poll(pf, 3, -1) < 0 && errno != EINTR)
            break;
        if (pf[2].revents)
            break; /* destroy */
        if (pf[0].revents & POLLIN) {
            struct ibv_cq *cq;
            void *cq_ctx;
            if (!ibv_get_cq_event(t->channel, &cq, &cq_ctx))
                ibv_ack_cq_events(cq, 1);
        }
        if (pf[1].revents & POLLIN)
            on_async_event(t);
    }
    return NULL;
}

int vb_start_progress(vb_transport *t)
{
    if (!t->efd_shared)
        t->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    t->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (t->efd < 0 || t->wake_fd < 0 || vb_set_nonblock(t->channel->fd) ||
        vb_set_nonblock(t->ctx->async_fd)) {
        vb_fail(t, "verbs: cannot create event fds: %s", strerror(errno));
        return -1;
    }
    if (pthread_create(&t->thread, NULL, progress_main, t)) {
        vb_fail(t, "verbs: cannot start the progress thread");
        return -1;
    }
    t->thread_started = 1;
    return 0;
}

void vb_stop_progress(vb_transport *t)
{
    if (t->thread_started) {
        __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
        uint64_t one = 1;
        if (write(t->wake_fd, &one, sizeof one) < 0) {
            /* cannot fail on a fresh eventfd */
        }
        pthread_join(t->thread, NULL);
        t->thread_started = 0;
    }
}

#endif /* PDKV_HAVE_VERBS */
