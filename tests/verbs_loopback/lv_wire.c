/* Loopback verbs device: the wire between processes and the responder side of RC WRITE.
 *
 * Every process that opens a device listens on the abstract Unix socket "pdkv-loopverbs-<pid>";
 * its GID is ::ffff:127.<pid as 3 bytes>, so a destination GID names the process to connect to
 * (with PDKV_LOOPBACK_LINK=ib: "pdkv-loopverbs-lid-<lid>", addressed by LID).
 * One receiver thread per incoming QP stream validates each frame header before a payload byte
 * is placed: destination QP connected to this source QP, QP and MR allow REMOTE_WRITE, same PD,
 * [raddr, raddr+len) inside the MR (overflow-safe). A bad frame's payload is read and discarded,
 * the responder QP goes to ERR with an IBV_EVENT_QP_ACCESS_ERR async event, and the requester
 * gets a NAK (IBV_WC_REM_ACCESS_ERR). WRITE_WITH_IMM consumes a posted receive (SRQ or RQ); if
 * none appears within LV_RNR_WAIT_MS (env PDKV_LOOPBACK_RNR_MS) it is receiver-not-ready
 * (IBV_WC_RNR_RETRY_EXC_ERR).
 */
#include "lv_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

struct lv_rx { pthread_t thread; int fd; struct lv_rx *next; };

static int g_listen_refs, g_listen_fd = -1;
static pthread_t g_listen_thread;
static struct lv_rx *g_rx;

/* PDKV_LOOPBACK_LINK=ib makes the port InfiniBand: peers are addressed by LID (no GRH), and
 * the listener is named by the LID instead of the pid. Default: Ethernet (RoCE, GID + GRH). */
int lv_link_is_ib(void)
{
    static int ib = -1;
    if (ib < 0) {
        const char *env = getenv("PDKV_LOOPBACK_LINK");
        ib = env && !strcmp(env, "ib");
    }
    return ib;
}

uint16_t lv_local_lid(void) { return lv_link_is_ib() ? (uint16_t)(getpid() % 0xbffe + 1) : 0; }

void lv_local_gid(union ibv_gid *gid)
{
    uint32_t pid = (uint32_t)getpid();
    memset(gid, 0, sizeof *gid);
    if (lv_link_is_ib()) { /* a link-local port GID: fe80::<pid> */
        gid->raw[0] = 0xfe;
        gid->raw[1] = 0x80;
    } else {
        gid->raw[10] = gid->raw[11] = 0xff;
        gid->raw[12] = 127;
    }
    gid->raw[13] = (uint8_t)(pid >> 16);
    gid->raw[14] = (uint8_t)(pid >> 8);
    gid->raw[15] = (uint8_t)pid;
}

/* Listener names: "pdkv-loopverbs-<pid>" (RoCE) or "pdkv-loopverbs-lid-<lid>" (IB). */
static socklen_t sock_addr(struct sockaddr_un *a, const char *kind, uint32_t id)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "pdkv-loopverbs-%s%u", kind, id);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static int connect_to(const char *kind, uint32_t id)
{
    struct sockaddr_un a;
    socklen_t alen = sock_addr(&a, kind, id);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, alen)) {
        close(fd);
        fd = -1;
    }
    return fd;
}

int lv_connect_lid(uint16_t lid) { return lid ? connect_to("lid-", lid) : -1; }

int lv_read_full(int fd, void *buf, size_t len)
{
    for (char *p = buf; len;) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int lv_write_full(int fd, const void *buf, size_t len)
{
    for (const char *p = buf; len;) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int lv_connect_gid(const union ibv_gid *gid)
{
    static const uint8_t prefix[13] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127};
    if (memcmp(gid->raw, prefix, sizeof prefix))
        return -1;
    return connect_to("", (uint32_t)gid->raw[13] << 16 | (uint32_t)gid->raw[14] << 8 |
                              gid->raw[15]);
}

/* Called with g_mu held. Returns 0, or the NAK status for this frame. */
static int check_frame(struct lv_qp *q, uint32_t src_qpn, const struct lv_frame *f,
                       struct lv_mr **mr_out)
{
    if (!q || q->qp.state == IBV_QPS_ERR || q->qp.state < IBV_QPS_RTR || q->dest_qpn != src_qpn)
        return IBV_WC_RETRY_EXC_ERR; /* packets to a missing/unconnected QP are dropped */
    struct lv_mr *m = lv_find_mr_rkey(f->rkey);
    if (!(q->access & IBV_ACCESS_REMOTE_WRITE) || !m || m->mr.pd != q->qp.pd ||
        !(m->access & IBV_ACCESS_REMOTE_WRITE) || f->raddr < m->iova || f->len > m->mr.length ||
        f->raddr - m->iova > m->mr.length - f->len)
        return IBV_WC_REM_ACCESS_ERR;
    *mr_out = m;
    return 0;
}

/* Called with g_mu held: wait for a posted receive; the QP may vanish while we wait. */
static int take_recv(uint32_t qpn, uint64_t *wr_id)
{
    static long wait_ms = -1;
    if (wait_ms < 0) { /* PDKV_LOOPBACK_RNR_MS shortens the wait for tests of the RNR path */
        const char *env = getenv("PDKV_LOOPBACK_RNR_MS");
        wait_ms = env && *env ? atol(env) : LV_RNR_WAIT_MS;
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_nsec += (wait_ms % 1000) * 1000000L;
    dl.tv_sec += wait_ms / 1000 + dl.tv_nsec / 1000000000L;
    dl.tv_nsec %= 1000000000L;
    for (;;) {
        struct lv_qp *q = lv_find_qp(qpn);
        if (!q)
            return IBV_WC_RETRY_EXC_ERR;
        struct lv_rq *rq = q->qp.srq ? &((struct lv_srq *)q->qp.srq)->rq : &q->rq;
        if (!lv_rq_pop(rq, wr_id))
            return 0;
        if (pthread_cond_timedwait(&g_cond, &g_mu, &dl) == ETIMEDOUT)
            return IBV_WC_RNR_RETRY_EXC_ERR;
    }
}

static void *rx_main(void *arg)
{
    int fd = ((struct lv_rx *)arg)->fd;
    struct lv_hello h;
    struct lv_frame f;
    static char scratch[65536];
    if (lv_read_full(fd, &h, sizeof h) || h.magic != LV_MAGIC)
        return NULL;
    while (!lv_read_full(fd, &f, sizeof f)) {
        struct lv_mr *m = NULL;
        uint64_t recv_id = 0;
        pthread_mutex_lock(&g_mu);
        struct lv_qp *q = lv_find_qp(h.dst_qpn);
        int st = check_frame(q, h.src_qpn, &f, &m);
        if (!st && f.has_imm)
            st = take_recv(h.dst_qpn, &recv_id);
        if (st == IBV_WC_REM_ACCESS_ERR) { /* the responder QP breaks too, as in real RC */
            lv_qp_fail(q, IBV_WC_WR_FLUSH_ERR);
            lv_async_event(q->qp.context, IBV_EVENT_QP_ACCESS_ERR, &q->qp);
        }
        if (m)
            m->busy++; /* NOTE: dereg waits for this: the payload lands in live memory only */
        pthread_mutex_unlock(&g_mu);
        int rc = 0;
        if (!st) {
            rc = lv_read_full(fd, (char *)m->mr.addr + (f.raddr - m->iova), f.len);
        } else {
            for (uint64_t left = f.len; !rc && left;) { /* discard: never touch the region */
                size_t n = left < sizeof scratch ? left : sizeof scratch;
                rc = lv_read_full(fd, scratch, n);
                left -= n;
            }
        }
        pthread_mutex_lock(&g_mu);
        struct lv_qp *landed = !rc && !st ? lv_find_qp(h.dst_qpn) : NULL; /* q may be gone */
        if (landed)
            lv_count(landed->qp.context->device, 1, f.len);
        if (m)
            m->busy--;
        pthread_cond_broadcast(&g_cond);
        pthread_mutex_unlock(&g_mu);
        /* Ack first, then complete the receive, as a NIC does: a target that tears its QP down
         * on seeing the immediate cannot leave the writer without its ack. */
        struct lv_ack a = {f.seq, (uint32_t)st, 0};
        if (!rc)
            rc = lv_write_full(fd, &a, sizeof a);
        pthread_mutex_lock(&g_mu);
        if (!rc && !st && f.has_imm && (q = lv_find_qp(h.dst_qpn))) {
            struct ibv_wc wc;
            memset(&wc, 0, sizeof wc);
            wc.wr_id = recv_id;
            wc.status = IBV_WC_SUCCESS;
            wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
            wc.byte_len = (uint32_t)f.len;
            wc.imm_data = f.imm_be;
            wc.qp_num = h.dst_qpn;
            wc.src_qp = h.src_qpn;
            wc.wc_flags = IBV_WC_WITH_IMM;
            lv_cq_push((struct lv_cq *)q->qp.recv_cq, &wc);
        }
        pthread_mutex_unlock(&g_mu);
        if (rc)
            break;
    }
    return NULL;
}

static void *listen_main(void *arg)
{
    for (;;) {
        int fd = accept4(g_listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            return NULL; /* shut down by lv_listener_release */
        }
        struct lv_rx *rx = calloc(1, sizeof *rx);
        pthread_mutex_lock(&g_mu);
        if (rx && (rx->fd = fd, pthread_create(&rx->thread, NULL, rx_main, rx) == 0)) {
            rx->next = g_rx;
            g_rx = rx;
        } else {
            close(fd);
            free(rx);
        }
        pthread_mutex_unlock(&g_mu);
    }
}

int lv_listener_acquire(void)
{
    int rc = 0;
    pthread_mutex_lock(&g_mu);
    if (g_listen_refs == 0) {
        struct sockaddr_un a;
        socklen_t alen = lv_link_is_ib() ? sock_addr(&a, "lid-", lv_local_lid())
                                         : sock_addr(&a, "", (uint32_t)getpid());
        g_listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (g_listen_fd < 0 || bind(g_listen_fd, (struct sockaddr *)&a, alen) ||
            listen(g_listen_fd, 64) || pthread_create(&g_listen_thread, NULL, listen_main, NULL)) {
            if (g_listen_fd >= 0)
                close(g_listen_fd);
            g_listen_fd = -1;
            rc = -1;
        }
    }
    if (!rc)
        g_listen_refs++;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* The last close stops the listener and every receiver thread: nothing is left running. */
void lv_listener_release(void)
{
    pthread_mutex_lock(&g_mu);
    if (--g_listen_refs > 0) {
        pthread_mutex_unlock(&g_mu);
        return;
    }
    shutdown(g_listen_fd, SHUT_RDWR);
    pthread_mutex_unlock(&g_mu);
    pthread_join(g_listen_thread, NULL); /* no new receiver after this */
    close(g_listen_fd);
    pthread_mutex_lock(&g_mu);
    g_listen_fd = -1;
    struct lv_rx *rx = g_rx;
    g_rx = NULL;
    for (struct lv_rx *r = rx; r; r = r->next)
        shutdown(r->fd, SHUT_RDWR);
    pthread_cond_broadcast(&g_cond);
    pthread_mutex_unlock(&g_mu);
    while (rx) {
        struct lv_rx *next = rx->next;
        pthread_join(rx->thread, NULL);
        close(rx->fd);
        free(rx);
        rx = next;
    }
}
