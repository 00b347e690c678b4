/* tcp transport: one sender thread per outgoing stream.
 *
 * The thread takes a burst of queued writes (up to BURST_OPS writes / BURST_BYTES bytes) and
 * hands header+payload pairs to the kernel with one sendmsg() per burst, so small pages cost a
 * fraction of a syscall each and large pages go out without any copy in user space. A write
 * completes (WRITE_DONE) when all of its bytes are in the kernel: the source may be reused.
 * While idle it also watches the socket for an ERROR frame (the peer refused a write) or EOF.
 * A sealed stream (tls_data, tcp_seal.c) sends each write as two records instead, its header's
 * and its payload's, encrypted through the stream's scratch buffer (the one copy it costs).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "tcp_internal.h"

#define BURST_OPS 64
#define BURST_BYTES (4u << 20)

/* Read the peer's ERROR frame (or EOF) from a writer socket into reason. */
static void read_peer_reason(tcp_stream *s, char *reason, size_t n) {
    tcp_frame f;
    char why[PDKV_REASON_MAX];
    int r = tcp_recv_all(s->fd, &f, sizeof(f));
    if (r == 0) {
        snprintf(reason, n, "peer %llu closed the connection", (unsigned long long)s->conn->peer);
        return;
    }
    if (r < 0) {
        snprintf(reason, n, "connection to peer %llu lost: %s", (unsigned long long)s->conn->peer, strerror(-r));
        return;
    }
    if (tcp_frame_parse(&f, &f, why, sizeof(why)) < 0 || f.type != TCP_FR_ERROR) {
        snprintf(reason, n, "peer %llu sent garbage on a write stream", (unsigned long long)s->conn->peer);
        return;
    }
    char msg[TCP_MAX_REASON + 1];
    if (tcp_recv_all(s->fd, msg, f.len) <= 0 && f.len) f.len = 0;
    msg[f.len] = 0;
    snprintf(reason, n, "peer %llu refused a write: %s", (unsigned long long)s->conn->peer, msg);
}

static void complete_ops(tcp_stream *s, tcp_op *ops, int n, int status, const char *reason) {
    tcp_t *t = s->t;
    pdkv_completion cp[BURST_OPS];
    uint64_t bytes = 0;
    for (int i = 0; i < n;) {
        int k = 1; /* a burst mostly reads one region: unpin runs of the same key at once */
        while (i + k < n && ops[i + k].lkey == ops[i].lkey) k++;
        pdkv_regions_unpin_n(&t->regions, ops[i].lkey, (uint32_t)k);
        i += k;
    }
    for (int i = 0; i < n; i++) {
        pdkv_completion *c = &cp[i];
        c->kind = status ? PDKV_CQ_ERROR : PDKV_CQ_WRITE_DONE;
        c->imm = 0;
        c->wr_id = ops[i].wr_id;
        c->peer = s->conn->peer;
        c->len = ops[i].hdr.len;
        c->status = status;
        if (status)
            snprintf(c->reason, sizeof(c->reason), "%s", reason);
        else
            c->reason[0] = 0;
        bytes += ops[i].hdr.len + sizeof(tcp_frame);
    }
    __atomic_sub_fetch(&s->queued_bytes, bytes, __ATOMIC_RELAXED);
    pdkv_cq_push_n(&t->cq, cp, n);
}

/* Send a burst; 0, or -errno (the connection is then unusable). */
static int send_burst(tcp_stream *s, tcp_op *ops, int n) {
    struct iovec iov[2 * BURST_OPS];
    int niov = 0;
    for (int i = 0; i < n; i++) {
        iov[niov++] = (struct iovec){&ops[i].hdr, sizeof(tcp_frame)};
        if (ops[i].hdr.len) iov[niov++] = (struct iovec){(void *)ops[i].src, ops[i].hdr.len};
    }
    struct iovec *v = iov;
    while (niov > 0) {
        struct msghdr m = {.msg_iov = v, .msg_iovlen = niov};
        ssize_t r = sendmsg(s->fd, &m, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        while (niov > 0 && (size_t)r >= v->iov_len) {
            r -= v->iov_len;
            v++;
            niov--;
        }
        if (niov > 0) {
            v->iov_base = (char *)v->iov_base + r;
            v->iov_len -= r;
        }
    }
    return 0;
}

/* Sealed: each write as a header record and a payload record (each + its tag), packed into the
 * stream's scratch buffer across the burst and sent as it fills; 0 or -errno. */
static int send_sealed(tcp_stream *s, tcp_op *ops, int n) {
    uint8_t *buf = s->scratch;
    const size_t cap = TCP_SEAL_CHUNK + sizeof(tcp_frame) + 2 * TCP_TAG_LEN, hdr = sizeof(tcp_frame) + TCP_TAG_LEN;
    size_t have = 0;
    int r;
#define FLUSH()                                                    \
    do {                                                           \
        if (have && (r = tcp_send_all(s->fd, buf, have)) < 0) return r; \
        have = 0;                                                  \
    } while (0)
    for (int i = 0; i < n; i++) {
        if (have + hdr > cap) FLUSH();
        if (tcp_seal_begin(&s->seal) ||
            tcp_seal_update(&s->seal, buf + have, (const uint8_t *)&ops[i].hdr, sizeof(tcp_frame)) ||
            tcp_seal_end(&s->seal, buf + have + sizeof(tcp_frame)))
            return -EIO;
        have += hdr;
        uint64_t len = ops[i].hdr.len, done = 0;
        if (!len) continue;
        if (tcp_seal_begin(&s->seal)) return -EIO;
        while (done < len) { /* NOTE: room for the tag is always kept after the chunk */
            if (cap - have <= TCP_TAG_LEN) FLUSH();
            size_t room = cap - have - TCP_TAG_LEN;
            size_t chunk = len - done < room ? (size_t)(len - done) : room;
            if (tcp_seal_update(&s->seal, buf + have, ops[i].src + done, chunk)) return -EIO;
            have += chunk;
            done += chunk;
        }
        if (tcp_seal_end(&s->seal, buf + have)) return -EIO;
        have += TCP_TAG_LEN;
    }
    FLUSH();
#undef FLUSH
    return 0;
}

void *tcp_tx_main(void *arg) {
    tcp_stream *s = arg;
    tcp_op burst[BURST_OPS];
    char reason[PDKV_REASON_MAX];
    int status = 0;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        int n = 0;
        uint64_t bytes = 0;
        while (n < BURST_OPS && s->qcount && (n == 0 || bytes < BURST_BYTES)) {
            burst[n] = s->q[s->qhead];
            bytes += burst[n].hdr.len;
            n++;
            s->qhead = (s->qhead + 1) % s->qcap;
            s->qcount--;
        }
        int dead = s->dead;
        if (n == 0 && !dead) s->sleeping = 1;
        pthread_mutex_unlock(&s->mu);
        if (dead) {
            complete_ops(s, burst, n, -ECONNRESET, s->conn->reason);
            break;
        }
        if (n) {
            int rc = s->conn->sealed ? send_sealed(s, burst, n) : send_burst(s, burst, n);
            if (rc < 0) {
                /* the peer may have said why before closing */
                if (rc == -EPIPE || rc == -ECONNRESET)
                    read_peer_reason(s, reason, sizeof(reason));
                else
                    snprintf(reason, sizeof(reason), "send to peer %llu failed: %s",
                             (unsigned long long)s->conn->peer, strerror(-rc));
                complete_ops(s, burst, n, rc, reason);
                status = rc;
                break;
            }
            complete_ops(s, burst, n, 0, NULL);
            continue;
        }
        struct pollfd pf[2] = {{s->wake_fd, POLLIN, 0}, {s->fd, POLLIN, 0}};
        poll(pf, 2, -1);
        uint64_t v;
        if (pf[0].revents) {
            ssize_t r = read(s->wake_fd, &v, sizeof(v));
            (void)r;
        }
        pthread_mutex_lock(&s->mu);
        s->sleeping = 0;
        dead = s->dead;
        pthread_mutex_unlock(&s->mu);
        if (!dead && (pf[1].revents & (POLLIN | POLLHUP | POLLERR))) {
            read_peer_reason(s, reason, sizeof(reason));
            status = -ECONNRESET;
            break;
        }
    }
    if (status) tcp_conn_fail(s->t, s->conn, status, reason);
    /* fail whatever is still queued; later posts see dead and fail on their own */
    pthread_mutex_lock(&s->mu);
    s->dead = 1;
    while (s->qcount) {
        int n = 0;
        while (n < BURST_OPS && s->qcount) {
            burst[n++] = s->q[s->qhead];
            s->qhead = (s->qhead + 1) % s->qcap;
            s->qcount--;
        }
        complete_ops(s, burst, n, -ECONNRESET, s->conn->reason);
    }
    if (s->fd >= 0) {
        close(s->fd);
        s->fd = -1;
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}
