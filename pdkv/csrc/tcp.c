/* tcp transport: one-sided writes with immediates, in user space (see transport.h, tcp_wire.h).
 * This file: the function table (creation, regions, post, poll, destroy); it calls down into
 * tcp_accept.c (listener, handshakes), tcp_conn.c (set-up), tcp_rx.c (receivers), tcp_state.c
 * (connection table), tcp_net.c (sockets).
 *
 * Each node listens on one port. prepare(peer) hands out a random token in the info blob (or
 * set_token binds the connection to a token of the authenticated control session instead);
 * complete(conn, info) opens num_streams sockets to the peer's listener and presents the token,
 * so a receiver knows which peer a stream belongs to and checks every frame against the
 * grants of that peer; a stream without a valid token gets no thread (tcp_accept.c). Writes are spread over the streams (least queued bytes first);
 * each stream has its own sender thread (tcp_tx.c), each incoming stream its receiver (tcp_rx.c).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "tcp_internal.h"

/* ---- vtable ---- */

static int t_reg(pdkv_transport *bt, void *addr, uint64_t len, uint64_t *key) {
    return pdkv_regions_add(&((tcp_t *)bt)->regions, addr, len, key, tcp_errbuf(), PDKV_ERR_MAX);
}
static int t_grant(pdkv_transport *bt, uint64_t key, uint64_t peer, uint64_t *key_out) {
    if (key_out) *key_out = key;
    return pdkv_regions_grant(&((tcp_t *)bt)->regions, key, peer, tcp_errbuf(), PDKV_ERR_MAX);
}
static int t_revoke(pdkv_transport *bt, uint64_t key, uint64_t peer) {
    return pdkv_regions_revoke(&((tcp_t *)bt)->regions, key, peer, tcp_errbuf(), PDKV_ERR_MAX);
}
static int t_grant_range(pdkv_transport *bt, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                         uint64_t *key_out) {
    if (key_out) *key_out = key;
    return pdkv_regions_grant_range(&((tcp_t *)bt)->regions, key, peer, off, len, tcp_errbuf(), PDKV_ERR_MAX);
}
static int t_revoke_range(pdkv_transport *bt, uint64_t key, uint64_t peer, uint64_t off, uint64_t len) {
    return pdkv_regions_revoke_range(&((tcp_t *)bt)->regions, key, peer, off, len, tcp_errbuf(), PDKV_ERR_MAX);
}
static void t_counters(pdkv_transport *bt, pdkv_transport_counters *out) {
    tcp_t *t = (tcp_t *)bt;
    out->refused_writes = __atomic_load_n(&t->refused_writes, __ATOMIC_RELAXED);
    out->refused_conns = __atomic_load_n(&t->refused_conns, __ATOMIC_RELAXED);
    out->pending_conns = __atomic_load_n(&t->pending_conns, __ATOMIC_RELAXED);
    out->rx_threads = __atomic_load_n(&t->rx_threads, __ATOMIC_RELAXED);
}
static int t_dereg(pdkv_transport *bt, uint64_t key) {
    return pdkv_regions_remove(&((tcp_t *)bt)->regions, key, tcp_errbuf(), PDKV_ERR_MAX);
}
static int t_post(pdkv_transport *bt, uint32_t id, const pdkv_write *w, int n) {
    tcp_t *t = (tcp_t *)bt;
    if (n <= 0) return 0;
    pthread_rwlock_rdlock(&t->lock);
    tcp_conn *c = tcp_conn_get(t, id);
    int state = c ? __atomic_load_n(&c->state, __ATOMIC_ACQUIRE) : 0;
    if (state != CONN_CONNECTED) {
        int rc = !c ? tcp_err(-ENOENT, "unknown connection %u", id)
                 : state == CONN_DEAD ? tcp_err(-ENOTCONN, "connection %u to peer %llu is down: %s", id,
                                                (unsigned long long)c->peer, c->reason)
                                      : tcp_err(-ENOTCONN, "connection %u is not complete yet", id);
        pthread_rwlock_unlock(&t->lock);
        return rc;
    }
    /* pin every source first: all or nothing */
    tcp_op stack_ops[256];
    const uint8_t *stack_src[256];
    tcp_op *ops = n <= 256 ? stack_ops : malloc((size_t)n * sizeof(*ops));
    const uint8_t **src = n <= 256 ? stack_src : malloc((size_t)n * sizeof(*src));
    int rc = (!ops || !src) ? tcp_err(-ENOMEM, "out of memory")
                            : pdkv_regions_pin_writes(&t->regions, w, n, src, tcp_errbuf(), PDKV_ERR_MAX);
    if (rc < 0) {
        if (ops != stack_ops) free(ops);
        if (src != stack_src) free(src);
        pthread_rwlock_unlock(&t->lock);
        return rc;
    }
    for (int i = 0; i < n; i++) {
        ops[i].src = src[i];
        ops[i].lkey = w[i].lkey;
        ops[i].wr_id = w[i].wr_id;
        tcp_frame_make(&ops[i].hdr, TCP_FR_DATA, w[i].rkey, w[i].roff, w[i].len, w[i].imm, w[i].has_imm);
    }
    if (src != stack_src) free(src);
    /* spread over the streams: each write goes to the stream with the fewest queued bytes */
    for (int i = 0; i < n; i++) {
        tcp_stream *best = &c->streams[0];
        uint64_t least = __atomic_load_n(&best->queued_bytes, __ATOMIC_RELAXED);
        for (uint32_t k = 1; k < c->num_streams; k++) {
            uint64_t b = __atomic_load_n(&c->streams[k].queued_bytes, __ATOMIC_RELAXED);
            if (b < least) {
                least = b;
                best = &c->streams[k];
            }
        }
        __atomic_add_fetch(&best->queued_bytes, ops[i].hdr.len + sizeof(tcp_frame), __ATOMIC_RELAXED);
        /* take a run of writes for this stream at once, up to its fair share of what is left */
        int run = 1;
        uint64_t share = 0;
        while (i + run < n && share < (1u << 20) && run < 64) {
            share += ops[i + run].hdr.len;
            __atomic_add_fetch(&best->queued_bytes, ops[i + run].hdr.len + sizeof(tcp_frame), __ATOMIC_RELAXED);
            run++;
            if (c->num_streams > 1 && ops[i].hdr.len >= (64u << 10)) break;
        }
        pthread_mutex_lock(&best->mu);
        if (best->dead) {
            pthread_mutex_unlock(&best->mu);
            for (int k = 0; k < run; k++) {
                pdkv_regions_unpin(&t->regions, ops[i + k].lkey);
                __atomic_sub_fetch(&best->queued_bytes, ops[i + k].hdr.len + sizeof(tcp_frame), __ATOMIC_RELAXED);
                pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, ops[i + k].wr_id, c->peer, ops[i + k].hdr.len, -ENOTCONN, 0,
                              "connection to peer %llu is down: %s", (unsigned long long)c->peer, c->reason);
            }
            i += run - 1;
            continue;
        }
        if (best->qcount + run > best->qcap) {
            uint32_t ncap = best->qcap;
            while (ncap < best->qcount + run) ncap *= 2;
            tcp_op *nq = malloc((size_t)ncap * sizeof(*nq));
            for (uint32_t k = 0; nq && k < best->qcount; k++) nq[k] = best->q[(best->qhead + k) % best->qcap];
            if (nq) {
                free(best->q);
                best->q = nq;
                best->qcap = ncap;
                best->qhead = 0;
            }
        }
        int room = (int)(best->qcap - best->qcount);
        for (int k = 0; k < run && k < room; k++) best->q[(best->qhead + best->qcount++) % best->qcap] = ops[i + k];
        int wake = best->sleeping;
        best->sleeping = 0;
        pthread_mutex_unlock(&best->mu);
        for (int k = room; k < run; k++) { /* only when out of memory */
            pdkv_regions_unpin(&t->regions, ops[i + k].lkey);
            __atomic_sub_fetch(&best->queued_bytes, ops[i + k].hdr.len + sizeof(tcp_frame), __ATOMIC_RELAXED);
            pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, ops[i + k].wr_id, c->peer, ops[i + k].hdr.len, -ENOMEM, 0,
                          "out of memory queueing a write");
        }
        if (wake) {
            uint64_t one = 1;
            ssize_t r = write(best->wake_fd, &one, sizeof(one));
            (void)r;
        }
        i += run - 1;
    }
    if (ops != stack_ops) free(ops);
    pthread_rwlock_unlock(&t->lock);
    return n;
}

static int t_poll(pdkv_transport *bt, pdkv_completion *out, int max) {
    return pdkv_cq_poll(&((tcp_t *)bt)->cq, out, max);
}
static int t_event_fd(pdkv_transport *bt) { return ((tcp_t *)bt)->cq.efd; }
static const char *t_last_error(pdkv_transport *bt) {
    (void)bt;
    return tcp_errbuf();
}

static void t_destroy(pdkv_transport *bt) {
    tcp_t *t = (tcp_t *)bt;
    __atomic_store_n(&t->stopping, 1, __ATOMIC_RELEASE);
    if (t->listener_started) {
        uint64_t one = 1;
        ssize_t r = write(t->stop_fd, &one, sizeof(one));
        (void)r;
        pthread_join(t->listener, NULL);
    }
    for (uint32_t i = 0; i < t->num_conns; i++)
        if (t->conns[i]) tcp_conn_free(t, t->conns[i]);
    tcp_rx_stop(t, 0, 1);
    free(t->conns);
    if (t->lfd >= 0) close(t->lfd);
    if (t->stop_fd >= 0) close(t->stop_fd);
    pdkv_regions_destroy(&t->regions);
    pdkv_cq_destroy(&t->cq);
    pthread_rwlock_destroy(&t->lock);
    pthread_mutex_destroy(&t->rxmu);
    free(t);
}

static const pdkv_transport_ops tcp_ops = {
    .name = "tcp", .reg = t_reg, .grant = t_grant, .revoke = t_revoke, .grant_range = t_grant_range,
    .revoke_range = t_revoke_range, .dereg = t_dereg, .prepare = tcp_prepare, .complete = tcp_complete,
    .set_token = tcp_set_token,
    .set_data_key = tcp_set_data_key,
    .disconnect = tcp_disconnect, .post = t_post, .poll = t_poll, .event_fd = t_event_fd,
    .last_error = t_last_error, .counters = t_counters, .destroy = t_destroy,
};

pdkv_transport *pdkv_tcp_create(uint64_t node_id, const pdkv_tcp_opts *o, char *err, size_t errlen) {
    const char *host = o->host && o->host[0] ? o->host : "127.0.0.1";
    if (o->num_streams < 1 || o->num_streams > 64) {
        snprintf(err, errlen, "tcp num_streams must be 1..64, got %u", o->num_streams);
        return NULL;
    }
    if (strlen(host) >= 64) {
        snprintf(err, errlen, "tcp host '%s' is too long", host);
        return NULL;
    }
    tcp_t *t = calloc(1, sizeof(*t));
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    t->base.ops = &tcp_ops;
    t->base.node_id = node_id;
    t->num_streams = o->num_streams;
    t->handshake_ms = o->handshake_ms ? o->handshake_ms : 5000;
    t->max_pending = o->max_pending ? o->max_pending : 64;
    t->max_per_source = o->max_per_source ? o->max_per_source : (t->max_pending + 3) / 4;
    t->lfd = t->stop_fd = -1;
    snprintf(t->host, sizeof(t->host), "%s", host);
    pthread_rwlock_init(&t->lock, NULL);
    pthread_mutex_init(&t->rxmu, NULL);
    pdkv_regions_init(&t->regions);
    int rc = pdkv_cq_init(&t->cq);
    if (rc < 0) {
        snprintf(err, errlen, "completion queue: %s", strerror(-rc));
        t->cq.efd = -1;
        goto fail;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST | AI_PASSIVE}, *res;
    char port[8];
    snprintf(port, sizeof(port), "%u", o->port);
    rc = getaddrinfo(host, port, &hints, &res);
    if (rc) {
        snprintf(err, errlen, "tcp listen address '%s' is not a numeric IP address: %s", host, gai_strerror(rc));
        goto fail;
    }
    t->lfd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (t->lfd >= 0) setsockopt(t->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (t->lfd < 0 || bind(t->lfd, res->ai_addr, res->ai_addrlen) < 0 || listen(t->lfd, 128) < 0) {
        snprintf(err, errlen, "cannot listen on %s:%u: %s", host, o->port, strerror(errno));
        freeaddrinfo(res);
        goto fail;
    }
    freeaddrinfo(res);
    struct sockaddr_storage sa;
    socklen_t sl = sizeof(sa);
    getsockname(t->lfd, (struct sockaddr *)&sa, &sl);
    t->port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port : ((struct sockaddr_in *)&sa)->sin_port);
    t->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (t->stop_fd < 0 || pthread_create(&t->listener, NULL, tcp_listener_main, t) != 0) {
        snprintf(err, errlen, "cannot start the tcp listener");
        goto fail;
    }
    t->listener_started = 1;
    return &t->base;
fail:
    t_destroy(&t->base);
    return NULL;
}

int pdkv_tcp_port(pdkv_transport *bt) {
    return bt && bt->ops == &tcp_ops ? ((tcp_t *)bt)->port : -1;
}
