/* Raw-verbs checks of the loopback device itself (what pdkv's transport does not provoke):
 * access flags, PD checks, receiver-not-ready, QP receive queues without an SRQ, signaled vs
 * unsignaled completions, local protection errors, async events and QP state rules.
 * Two device contexts in one process talk through the device's socket path, as two processes do.
 * Run with LD_LIBRARY_PATH at the loopback library and PDKV_LOOPBACK_RNR_MS=200.
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);          \
            fprintf(stderr, __VA_ARGS__);                                 \
            fprintf(stderr, "\n");                                        \
            exit(1);                                                      \
        }                                                                 \
    } while (0)

typedef struct ep {
    struct ibv_context *ctx;
    struct ibv_pd *pd, *pd2;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    union ibv_gid gid;
} ep;

static struct ibv_device **devs;

static void ep_open(ep *e)
{
    CHECK((e->ctx = ibv_open_device(devs[0])), "open");
    CHECK((e->pd = ibv_alloc_pd(e->ctx)) && (e->pd2 = ibv_alloc_pd(e->ctx)), "pd");
    CHECK((e->cq = ibv_create_cq(e->ctx, 64, NULL, NULL, 0)), "cq");
    CHECK(ibv_query_gid(e->ctx, 1, 0, &e->gid) == 0, "gid");
}

static void ep_qp(ep *e)
{
    struct ibv_qp_init_attr ia = {.send_cq = e->cq, .recv_cq = e->cq, .qp_type = IBV_QPT_RC,
                                  .cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1,
                                          .max_recv_sge = 1}};
    CHECK((e->qp = ibv_create_qp(e->pd, &ia)), "create qp");
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1,
                            .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE};
    CHECK(ibv_modify_qp(e->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                        IBV_QP_ACCESS_FLAGS) == 0, "INIT");
}

static int to_rtr(ep *e, const ep *peer, int global)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096,
                            .dest_qp_num = peer->qp->qp_num, .max_dest_rd_atomic = 1,
                            .min_rnr_timer = 12};
    a.ah_attr.port_num = 1;
    a.ah_attr.is_global = (uint8_t)global;
    a.ah_attr.grh.dgid = peer->gid;
    return ibv_modify_qp(e->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                        IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                        IBV_QP_MIN_RNR_TIMER);
}

static void connect_pair(ep *x, ep *y)
{
    ep_qp(x);
    ep_qp(y);
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTS};
    int rts = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
              IBV_QP_MAX_QP_RD_ATOMIC;
    CHECK(ibv_modify_qp(x->qp, &a, rts) == EINVAL, "RTS straight from INIT must be refused");
    CHECK(to_rtr(x, y, 0) == EINVAL, "RoCE RTR without a GRH must be refused");
    CHECK(to_rtr(x, y, 1) == 0 && to_rtr(y, x, 1) == 0, "RTR");
    CHECK(ibv_modify_qp(x->qp, &a, IBV_QP_STATE) == EINVAL, "RTS without its attributes");
    CHECK(ibv_modify_qp(x->qp, &a, rts) == 0 && ibv_modify_qp(y->qp, &a, rts) == 0, "RTS");
}

static void close_pair(ep *x, ep *y)
{
    CHECK(ibv_destroy_qp(x->qp) == 0 && ibv_destroy_qp(y->qp) == 0, "destroy qp");
}

static struct ibv_wc wait_wc(ep *e, int timeout_ms)
{
    struct ibv_wc wc;
    memset(&wc, 0, sizeof wc);
    for (int i = 0; i < timeout_ms; i++) {
        if (ibv_poll_cq(e->cq, 1, &wc) == 1)
            return wc;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    CHECK(0, "no completion within %d ms", timeout_ms);
    return wc;
}

static void expect_empty(ep *e)
{
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
    struct ibv_wc wc;
    CHECK(ibv_poll_cq(e->cq, 1, &wc) == 0, "unexpected completion (status %d, opcode %d)",
          wc.status, wc.opcode);
}

static int write_imm(ep *x, struct ibv_mr *src, uint64_t raddr, uint32_t rkey, uint32_t len,
                     int imm, int signaled, uint64_t wr_id)
{
    struct ibv_sge sge = {(uintptr_t)src->addr, len, src->lkey};
    struct ibv_send_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
                             .opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE,
                             .send_flags = signaled ? IBV_SEND_SIGNALED : 0,
                             .imm_data = htonl(0xabc)}, *bad;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    return ibv_post_send(x->qp, &wr, &bad);
}

static void post_recv(ep *y, uint64_t id)
{
    struct ibv_recv_wr r = {.wr_id = id}, *bad;
    CHECK(ibv_post_recv(y->qp, &r, &bad) == 0, "post_recv");
}

int main(void)
{
    int num = 0;
    CHECK((devs = ibv_get_device_list(&num)) && num >= 1, "device list");
    printf("devices: %d, first %s\n", num, ibv_get_device_name(devs[0]));
    ep x, y;
    ep_open(&x);
    ep_open(&y);
    static char src_buf[8192], dst_buf[8192];
    for (int i = 0; i < 8192; i++)
        src_buf[i] = (char)(i * 7);
    struct ibv_mr *src = ibv_reg_mr(x.pd, src_buf, sizeof src_buf, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *dst = ibv_reg_mr(y.pd, dst_buf, sizeof dst_buf,
                                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    struct ibv_mr *ro = ibv_reg_mr(y.pd, dst_buf, sizeof dst_buf, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *other_pd = ibv_reg_mr(y.pd2, dst_buf, sizeof dst_buf,
                                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    CHECK(src && dst && ro && other_pd, "reg_mr");
    CHECK(!ibv_reg_mr(y.pd, dst_buf, 64, IBV_ACCESS_REMOTE_WRITE) && errno == EINVAL,
          "REMOTE_WRITE without LOCAL_WRITE must be refused");
    uint64_t base = (uintptr_t)dst_buf;

    /* WRITE_WITH_IMM consumes a receive from the QP's own RQ; unsignaled writes stay silent */
    connect_pair(&x, &y);
    post_recv(&y, 91);
    CHECK(write_imm(&x, src, base + 100, dst->rkey, 1000, 0, 0, 1) == 0, "post unsignaled");
    CHECK(write_imm(&x, src, base + 2000, dst->rkey, 512, 1, 1, 2) == 0, "post imm");
    struct ibv_wc wc = wait_wc(&y, 2000);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && wc.wr_id == 91 &&
          ntohl(wc.imm_data) == 0xabc && wc.byte_len == 512 && (wc.wc_flags & IBV_WC_WITH_IMM),
          "receive completion");
    wc = wait_wc(&x, 2000);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 2 && wc.opcode == IBV_WC_RDMA_WRITE,
          "only the signaled write completes (got wr_id %llu)", (unsigned long long)wc.wr_id);
    expect_empty(&x);
    CHECK(!memcmp(dst_buf + 100, src_buf, 1000) && !memcmp(dst_buf + 2000, src_buf, 512), "bytes");

    /* no receive posted: receiver-not-ready after the retry budget; the QP then flushes */
    CHECK(write_imm(&x, src, base, dst->rkey, 8, 1, 0, 3) == 0, "post rnr");
    wc = wait_wc(&x, 5000);
    CHECK(wc.status == IBV_WC_RNR_RETRY_EXC_ERR && wc.wr_id == 3, "RNR status %d", wc.status);
    CHECK(write_imm(&x, src, base, dst->rkey, 8, 0, 0, 4) == 0, "post to an errored QP");
    wc = wait_wc(&x, 2000);
    CHECK(wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id == 4, "flush status %d", wc.status);
    close_pair(&x, &y);

    /* bad local key: local protection error, nothing sent */
    connect_pair(&x, &y);
    struct ibv_sge sge = {(uintptr_t)src_buf, 8, src->lkey + 999};
    struct ibv_send_wr wr = {.wr_id = 5, .sg_list = &sge, .num_sge = 1,
                             .opcode = IBV_WR_RDMA_WRITE}, *bad;
    wr.wr.rdma.remote_addr = base;
    wr.wr.rdma.rkey = dst->rkey;
    CHECK(ibv_post_send(x.qp, &wr, &bad) == 0, "post bad lkey");
    wc = wait_wc(&x, 2000);
    CHECK(wc.status == IBV_WC_LOC_PROT_ERR && wc.wr_id == 5, "local protection: %d", wc.status);
    close_pair(&x, &y);

    /* an MR without REMOTE_WRITE, and an MR of another PD: remote access errors, bytes intact,
     * and the responder learns through an async event */
    struct ibv_mr *bad_mrs[2] = {ro, other_pd};
    for (int i = 0; i < 2; i++) {
        connect_pair(&x, &y);
        memset(dst_buf, 0, sizeof dst_buf);
        CHECK(write_imm(&x, src, base, bad_mrs[i]->rkey, 64, 0, 1, 6) == 0, "post");
        wc = wait_wc(&x, 2000);
        CHECK(wc.status == IBV_WC_REM_ACCESS_ERR, "case %d: status %d", i, wc.status);
        for (int b = 0; b < 8192; b++)
            CHECK(dst_buf[b] == 0, "case %d: byte %d written", i, b);
        struct pollfd pf = {y.ctx->async_fd, POLLIN, 0};
        CHECK(poll(&pf, 1, 2000) == 1, "no async event");
        struct ibv_async_event ev;
        CHECK(ibv_get_async_event(y.ctx, &ev) == 0 && ev.event_type == IBV_EVENT_QP_ACCESS_ERR &&
              ev.element.qp == y.qp, "async event");
        ibv_ack_async_event(&ev);
        close_pair(&x, &y);
    }
    CHECK(ibv_dereg_mr(src) == 0 && ibv_dereg_mr(dst) == 0 && ibv_dereg_mr(ro) == 0 &&
          ibv_dereg_mr(other_pd) == 0, "dereg");
    ep *eps[2] = {&x, &y};
    for (int i = 0; i < 2; i++) {
        ibv_destroy_cq(eps[i]->cq);
        ibv_dealloc_pd(eps[i]->pd);
        ibv_dealloc_pd(eps[i]->pd2);
        ibv_close_device(eps[i]->ctx);
    }
    ibv_free_device_list(devs);
    printf("OK device\n");
    return 0;
}
