/* Loopback verbs device: completion queues, completion channels, receive queues, SRQs and
 * asynchronous events. */
#include "lv_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct lv_channel { struct ibv_comp_channel ch; int wfd; };

struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *ctx)
{
    struct lv_channel *c = calloc(1, sizeof *c);
    int fds[2];
    if (!c || pipe2(fds, O_CLOEXEC)) {
        free(c);
        return NULL;
    }
    fcntl(fds[1], F_SETFL, O_NONBLOCK);
    c->ch.context = ctx;
    c->ch.fd = fds[0];
    c->wfd = fds[1];
    return &c->ch;
}

int ibv_destroy_comp_channel(struct ibv_comp_channel *ch)
{
    struct lv_channel *c = (struct lv_channel *)ch;
    close(c->ch.fd);
    close(c->wfd);
    free(c);
    return 0;
}

/* Each event is the CQ pointer written into the channel's pipe (a CQ disarms when it fires). */
int ibv_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **cq_context)
{
    struct ibv_cq *got;
    if (lv_read_full(ch->fd, &got, sizeof got))
        return -1;
    *cq = got;
    *cq_context = got->cq_context;
    return 0;
}

void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents) { (void)cq; (void)nevents; }

struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
                             struct ibv_comp_channel *ch, int comp_vector)
{
    struct lv_cq *c = calloc(1, sizeof *c);
    if (!c || cqe <= 0) {
        free(c);
        errno = EINVAL;
        return NULL;
    }
    c->cap = cqe;
    c->ring = calloc(c->cap, sizeof *c->ring);
    if (!c->ring) {
        free(c);
        errno = ENOMEM;
        return NULL;
    }
    c->cq.context = ctx;
    c->cq.channel = ch;
    c->cq.cq_context = cq_context;
    c->cq.cqe = cqe;
    return &c->cq;
}

int ibv_destroy_cq(struct ibv_cq *cq)
{
    struct lv_cq *c = (struct lv_cq *)cq;
    free(c->ring);
    free(c);
    return 0;
}

int ibv_resize_cq(struct ibv_cq *cq, int cqe)
{
    if (cqe <= 0)
        return EINVAL;
    pthread_mutex_lock(&g_mu);
    struct lv_cq *c = (struct lv_cq *)cq;
    if (cqe < c->count) {
        pthread_mutex_unlock(&g_mu);
        return EINVAL;
    }
    cq->cqe = cqe; /* the ring grows on demand; only the overrun threshold moves */
    c->overrun_reported = 0;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

/* Called with g_mu held: PDKV_LOOPBACK_FAULTS=cq_error_after=N / poll_error_after=N (see
 * lv_internal.h) break the CQ once N completions were pushed into it. */
static int cq_breaks(struct lv_cq *c)
{
    long cq_err = lv_fault("cq_error_after"), poll_err = lv_fault("poll_error_after");
    c->pushed++;
    if (c->failed)
        return 1;
    if (cq_err > 0 && c->pushed > cq_err) { /* as an overrun: the event, and the CQ stalls */
        c->failed = 1;
        struct lv_context *ctx = (struct lv_context *)c->cq.context;
        if (ctx->num_events < (int)(sizeof ctx->events / sizeof ctx->events[0])) {
            struct ibv_async_event *e = &ctx->events[ctx->num_events++];
            memset(e, 0, sizeof *e);
            e->event_type = IBV_EVENT_CQ_ERR;
            e->element.cq = &c->cq;
            char one = 1;
            if (write(ctx->async_pipe[1], &one, 1) < 0) {
                /* cannot happen with fewer than 64 pending events in a pipe */
            }
        }
        return 1;
    }
    if (poll_err > 0 && c->pushed > poll_err) { /* ibv_poll_cq returns an error from now on */
        c->failed = 2;
        return 0;
    }
    return 0;
}

/* Called with g_mu held. A real CQ that holds more than its cqe entries overruns (fatal); here
 * the ring grows so nothing is lost, but the overrun is reported on stderr once, which the tests
 * treat as a failure of the caller's CQ sizing. */
void lv_cq_push(struct lv_cq *c, const struct ibv_wc *wc)
{
    if (cq_breaks(c) && c->failed == 1)
        return; /* the completion is lost, as in an overrun */
    if (c->count == c->cq.cqe && !c->overrun_reported) {
        c->overrun_reported = 1;
        fprintf(stderr, "loopback verbs: CQ overrun (%d entries)\n", c->cq.cqe);
    }
    if (c->count == c->cap) {
        struct ibv_wc *ring = calloc(c->cap * 2, sizeof *ring);
        if (!ring)
            abort(); /* test infrastructure: out of memory is not a case to model */
        for (int i = 0; i < c->count; i++)
            ring[i] = c->ring[(c->head + i) % c->cap];
        free(c->ring);
        c->ring = ring;
        c->head = 0;
        c->cap *= 2;
    }
    c->ring[(c->head + c->count++) % c->cap] = *wc;
    if (c->armed && c->cq.channel) {
        struct lv_channel *ch = (struct lv_channel *)c->cq.channel;
        struct ibv_cq *self = &c->cq;
        c->armed = 0;
        if (write(ch->wfd, &self, sizeof self) < 0) {
            /* pipe full: a wake-up is already pending for the reader */
        }
    }
}

/* Called with g_mu held: drop the CQEs of a destroyed QP, as providers do on ibv_destroy_qp. */
void lv_cq_purge_qp(struct lv_cq *c, uint32_t qpn)
{
    int kept = 0;
    for (int i = 0; i < c->count; i++) {
        struct ibv_wc wc = c->ring[(c->head + i) % c->cap];
        if (wc.qp_num != qpn)
            c->ring[(c->head + kept++) % c->cap] = wc;
    }
    c->count = kept;
}

int lv_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    struct lv_cq *c = (struct lv_cq *)cq;
    int got = 0;
    pthread_mutex_lock(&g_mu);
    if (c->failed == 2) {
        pthread_mutex_unlock(&g_mu);
        return -EIO; /* a provider's poll error: the CQ is unusable */
    }
    while (got < n && c->count) {
        wc[got++] = c->ring[c->head];
        c->head = (c->head + 1) % c->cap;
        c->count--;
    }
    pthread_mutex_unlock(&g_mu);
    return got;
}

int lv_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    pthread_mutex_lock(&g_mu);
    ((struct lv_cq *)cq)->armed = 1;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

int lv_rq_push(struct lv_rq *rq, uint64_t wr_id, int max)
{
    if (rq->count >= max)
        return ENOMEM;
    if (rq->count == rq->cap) {
        int cap = rq->cap ? rq->cap * 2 : 64;
        uint64_t *ids = calloc(cap, sizeof *ids);
        if (!ids)
            return ENOMEM;
        for (int i = 0; i < rq->count; i++)
            ids[i] = rq->ids[(rq->head + i) % rq->cap];
        free(rq->ids);
        rq->ids = ids;
        rq->head = 0;
        rq->cap = cap;
    }
    rq->ids[(rq->head + rq->count++) % rq->cap] = wr_id;
    return 0;
}

int lv_rq_pop(struct lv_rq *rq, uint64_t *wr_id)
{
    if (!rq->count)
        return -1;
    *wr_id = rq->ids[rq->head];
    rq->head = (rq->head + 1) % rq->cap;
    rq->count--;
    return 0;
}

struct ibv_srq *ibv_create_srq(struct ibv_pd *pd, struct ibv_srq_init_attr *attr)
{
    struct lv_srq *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->srq.context = pd->context;
    s->srq.srq_context = attr->srq_context;
    s->srq.pd = pd;
    s->max_wr = (int)attr->attr.max_wr;
    return &s->srq;
}

int ibv_destroy_srq(struct ibv_srq *srq)
{
    struct lv_srq *s = (struct lv_srq *)srq;
    free(s->rq.ids);
    free(s);
    return 0;
}

int lv_post_srq_recv(struct ibv_srq *srq, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    struct lv_srq *s = (struct lv_srq *)srq;
    int rc = 0;
    pthread_mutex_lock(&g_mu);
    for (; wr; wr = wr->next)
        if ((rc = lv_rq_push(&s->rq, wr->wr_id, s->max_wr))) {
            *bad = wr;
            break;
        }
    pthread_cond_broadcast(&g_cond);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* Called with g_mu held. */
void lv_async_event(struct ibv_context *ctx, enum ibv_event_type type, struct ibv_qp *qp)
{
    struct lv_context *c = (struct lv_context *)ctx;
    if (c->num_events == (int)(sizeof c->events / sizeof c->events[0]))
        return;
    struct ibv_async_event *e = &c->events[c->num_events++];
    memset(e, 0, sizeof *e);
    e->event_type = type;
    e->element.qp = qp;
    char one = 1;
    if (write(c->async_pipe[1], &one, 1) < 0) {
        /* cannot happen with fewer than 64 pending events in a pipe */
    }
}

/* Called with g_mu held from ibv_destroy_qp: pending events must not name a freed QP. */
void lv_async_purge_qp(struct ibv_context *ctx, struct ibv_qp *qp)
{
    struct lv_context *c = (struct lv_context *)ctx;
    int kept = 0;
    for (int i = 0; i < c->num_events; i++)
        if (c->events[i].element.qp != qp)
            c->events[kept++] = c->events[i];
    c->num_events = kept;
}

int ibv_get_async_event(struct ibv_context *ctx, struct ibv_async_event *event)
{
    struct lv_context *c = (struct lv_context *)ctx;
    char one;
    if (lv_read_full(c->async_pipe[0], &one, 1))
        return -1;
    pthread_mutex_lock(&g_mu);
    int got = c->num_events > 0;
    if (got) {
        *event = c->events[0];
        memmove(c->events, c->events + 1, --c->num_events * sizeof c->events[0]);
    }
    pthread_mutex_unlock(&g_mu);
    if (!got)
        errno = EAGAIN; /* its QP was destroyed before the event was read */
    return got ? 0 : -1;
}

void ibv_ack_async_event(struct ibv_async_event *event) { (void)event; }

const char *ibv_wc_status_str(enum ibv_wc_status status)
{
    switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    default: return "unknown";
    }
}
