/* tcp transport: the listener. ONE thread accepts every incoming stream and runs all handshakes
 * with poll() and a deadline, so nothing unauthenticated gets a thread of its own:
 *   - an accepted socket waits (non-blocking reads) until it has sent a whole hello;
 *   - a hello whose token is not one this node gave (or was given by its control session, see
 *     tcp_set_token) for that peer is answered with a refusal and closed, as is a socket that sent
 *     no whole hello within handshake_ms or closed early;
 *   - at most max_pending sockets wait at once, at most max_per_source of them from one address
 *     (one noisy host cannot take every slot); one more is closed at accept;
 *   - a connection takes exactly the streams its first accepted hello agreed (num_streams, at most
 *     TCP_MAX_STREAMS, each index once): a valid token opens no more receiver threads than that;
 *   - only an accepted hello gets an ACK and a receiver thread (tcp_rx.c).
 * Refusals are counted (refused_conns) and reported as ERROR completions, at most REPORT_BURST
 * per second: a flood of bad connections cannot flood the layer above (or its log) in turn.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tcp_internal.h"

#define REPORT_BURST 5 /* refusal reports per second; the rest are counted and summarised */
#define MAX_PENDING_CAP 1024

typedef struct pending {
    int fd;
    uint8_t src[16]; /* the peer's IP address (v4 in the first 4 bytes) */
    uint64_t deadline_ms;
    size_t have;
    uint8_t buf[sizeof(tcp_hello)];
} pending;

typedef struct limiter {
    uint64_t window_ms;
    uint32_t sent, suppressed;
} limiter;

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Count a refusal; report it unless REPORT_BURST were reported in the last second. */
static void refuse(tcp_t *t, limiter *l, uint64_t peer, int status, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void refuse(tcp_t *t, limiter *l, uint64_t peer, int status, const char *fmt, ...) {
    __atomic_add_fetch(&t->refused_conns, 1, __ATOMIC_RELAXED);
    uint64_t now = now_ms();
    if (now - l->window_ms >= 1000) {
        l->window_ms = now;
        l->sent = 0;
    }
    if (l->sent >= REPORT_BURST) {
        l->suppressed++;
        return;
    }
    l->sent++;
    char why[PDKV_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, 0, peer, 0, status, 0, "rejected a connection: %s", why);
}

/* Once the window that suppressed reports is over, say how many were not reported. */
static void flush(tcp_t *t, limiter *l, uint64_t now) {
    if (!l->suppressed || now - l->window_ms < 1000) return;
    pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, 0, 0, 0, -EACCES, 0,
                  "rejected %u more connections (reports are limited to %d per second)", l->suppressed,
                  REPORT_BURST);
    l->suppressed = 0;
    l->window_ms = now;
    l->sent = 0;
}

/* An ACK: accepted (reason NULL) or refused. Never blocks: the socket's buffer is empty. */
static void send_ack(int fd, const char *reason) {
    tcp_frame f;
    size_t n = reason ? strlen(reason) : 0;
    tcp_frame_make(&f, TCP_FR_ACK, 0, 0, n, 0, 0);
    struct iovec iov[2] = {{&f, sizeof(f)}, {(void *)reason, n}};
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = n ? 2 : 1};
    ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)r;
}

/* The stream a hello names, on connection c: 0, or -EPROTO with the reason (listener thread). */
static int take_stream(tcp_conn *c, const tcp_hello *h, char *why, size_t n) {
    uint32_t agreed = c->rx_num_streams ? c->rx_num_streams : h->num_streams;
    if (h->num_streams < 1 || h->num_streams > TCP_MAX_STREAMS) {
        snprintf(why, n, "hello for connection %u says %u streams (1..%d)", c->id, h->num_streams, TCP_MAX_STREAMS);
        return -EPROTO;
    }
    if (h->num_streams != agreed) {
        snprintf(why, n, "hello for connection %u says %u streams, its first stream said %u", c->id,
                 h->num_streams, agreed);
        return -EPROTO;
    }
    if (h->stream >= agreed) {
        snprintf(why, n, "stream %u of connection %u is outside its %u streams", h->stream, c->id, agreed);
        return -EPROTO;
    }
    if (c->rx_streams_seen & (1ull << h->stream)) {
        snprintf(why, n, "stream %u of connection %u was accepted already", h->stream, c->id);
        return -EPROTO;
    }
    c->rx_num_streams = agreed;
    c->rx_streams_seen |= 1ull << h->stream;
    return 0;
}

/* A whole hello arrived: start its receiver or refuse it. The socket is consumed either way. */
static void finish(tcp_t *t, limiter *l, pending *p) {
    tcp_hello h;
    memcpy(&h, p->buf, sizeof(h));
    char why[PDKV_REASON_MAX];
    uint32_t conn = 0;
    uint8_t key[TCP_DATA_KEY_LEN];
    int sealed = 0, status = -EACCES;
    if (h.magic != TCP_HELLO_MAGIC || h.version != TCP_VERSION) {
        snprintf(why, sizeof(why), "not a pdkv tcp v%u hello (magic 0x%08x version %u)", TCP_VERSION, h.magic,
                 h.version);
        status = -EPROTO;
    } else {
        /* NOTE: the read lock is enough for rx_*: only this thread touches them */
        pthread_rwlock_rdlock(&t->lock);
        tcp_conn *c = tcp_conn_by_token(t, h.node_id, h.token);
        if (c && (status = take_stream(c, &h, why, sizeof(why))) == 0) {
            conn = c->id;
            if ((sealed = c->sealed)) memcpy(key, c->data_key, sizeof(key));
        }
        pthread_rwlock_unlock(&t->lock);
        if (!c) {
            snprintf(why, sizeof(why), "connection from node %llu with a token this node did not give it",
                     (unsigned long long)h.node_id);
            status = -EACCES;
        }
    }
    if (conn) {
        tcp_sockopts(p->fd);
        send_ack(p->fd, NULL);
        if (tcp_rx_start(t, p->fd, h.node_id, conn, h.stream, sealed ? key : NULL) == 0)
            return; /* the receiver owns the fd now */
        snprintf(why, sizeof(why), "cannot start a receiver thread");
        status = -ENOMEM;
    } else {
        send_ack(p->fd, why);
    }
    refuse(t, l, h.magic == TCP_HELLO_MAGIC ? h.node_id : 0, status, "%s", why);
    close(p->fd);
}

/* The IP address of a peer, for the per-source cap (ports differ per connection). */
static void source_of(const struct sockaddr_storage *sa, uint8_t out[16]) {
    memset(out, 0, 16);
    if (sa->ss_family == AF_INET)
        memcpy(out, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    else if (sa->ss_family == AF_INET6)
        memcpy(out, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
}

/* Read what the socket has; 1: the hello is complete, 0: wait for more, -1: it closed. */
static int feed(pending *p) {
    ssize_t r = recv(p->fd, p->buf + p->have, sizeof(p->buf) - p->have, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (r <= 0) return -1;
    p->have += (size_t)r;
    return p->have == sizeof(p->buf);
}

void *tcp_listener_main(void *arg) {
    tcp_t *t = arg;
    uint32_t cap = t->max_pending < MAX_PENDING_CAP ? t->max_pending : MAX_PENDING_CAP;
    pending *ps = calloc(cap, sizeof(*ps));
    struct pollfd *pf = calloc(cap + 2, sizeof(*pf));
    limiter lim = {0};
    uint32_t n = 0;
    while (ps && pf) {
        uint64_t now = now_ms();
        int timeout = -1;
        pf[0] = (struct pollfd){t->lfd, POLLIN, 0};
        pf[1] = (struct pollfd){t->stop_fd, POLLIN, 0};
        for (uint32_t i = 0; i < n; i++) {
            pf[2 + i] = (struct pollfd){ps[i].fd, POLLIN, 0};
            int left = ps[i].deadline_ms > now ? (int)(ps[i].deadline_ms - now) : 0;
            if (timeout < 0 || left < timeout) timeout = left;
        }
        if (lim.suppressed) { /* wake up to report the suppressed count */
            int left = lim.window_ms + 1000 > now ? (int)(lim.window_ms + 1000 - now) : 0;
            if (timeout < 0 || left < timeout) timeout = left;
        }
        if (poll(pf, 2 + n, timeout) < 0 && errno != EINTR) break;
        if (__atomic_load_n(&t->stopping, __ATOMIC_ACQUIRE) || pf[1].revents) break;
        now = now_ms();
        /* handshakes first: a slot freed here can take the connection accepted below */
        for (uint32_t i = 0; i < n;) {
            pending *p = &ps[i];
            int r = pf[2 + i].revents ? feed(p) : 0;
            if (r == 0 && now < p->deadline_ms) {
                i++;
                continue;
            }
            if (r > 0)
                finish(t, &lim, p);
            else if (r < 0) { /* gone before a whole hello: a port scan or a dead peer */
                __atomic_add_fetch(&t->refused_conns, 1, __ATOMIC_RELAXED);
                close(p->fd);
            } else {
                refuse(t, &lim, 0, -ETIMEDOUT, "no valid hello within %u ms", t->handshake_ms);
                close(p->fd);
            }
            /* keep pf[] in step with ps[]: the moved entry's revents were read already */
            ps[i] = ps[--n];
            pf[2 + i] = pf[2 + n];
        }
        __atomic_store_n(&t->pending_conns, n, __ATOMIC_RELAXED);
        flush(t, &lim, now);
        if (!(pf[0].revents & POLLIN)) continue;
        struct sockaddr_storage sa;
        socklen_t sl = sizeof(sa);
        int fd = accept4(t->lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC);
        if (fd < 0) continue; /* EMFILE and friends: poll again, the deadlines still run */
        pending np = {.fd = fd, .deadline_ms = now + t->handshake_ms};
        source_of(&sa, np.src);
        uint32_t same = 0;
        for (uint32_t i = 0; i < n; i++) same += !memcmp(ps[i].src, np.src, sizeof(np.src));
        if (n == cap || same >= t->max_per_source) {
            if (n == cap)
                refuse(t, &lim, 0, -EBUSY, "%u connections are already waiting for their hello", cap);
            else
                refuse(t, &lim, 0, -EBUSY, "%u connections from that address are already waiting for their hello",
                       same);
            close(fd);
            continue;
        }
        ps[n++] = np;
        __atomic_store_n(&t->pending_conns, n, __ATOMIC_RELAXED);
    }
    for (uint32_t i = 0; ps && i < n; i++) close(ps[i].fd);
    __atomic_store_n(&t->pending_conns, 0, __ATOMIC_RELAXED);
    free(ps);
    free(pf);
    return NULL;
}
