/* tcp transport, connections: the two-phase set-up (prepare hands out a token, complete dials
 * the peer's listener num_streams times and presents it), failure and teardown. */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "tcp_internal.h"

#define CONNECT_TIMEOUT_S 10

int tcp_prepare(pdkv_transport *bt, uint64_t peer, void *info_out, uint32_t *info_len, uint32_t *conn_out) {
    tcp_t *t = (tcp_t *)bt;
    tcp_conn *c = calloc(1, sizeof(*c));
    if (!c) return tcp_err(-ENOMEM, "out of memory");
    c->peer = peer;
    c->state = CONN_PREPARED;
    c->num_streams = t->num_streams;
    pthread_mutex_init(&c->mu, NULL);
    if (getrandom(c->token, sizeof(c->token), 0) != sizeof(c->token)) {
        free(c);
        return tcp_err(-EIO, "getrandom failed: %s", strerror(errno));
    }
    pthread_rwlock_wrlock(&t->lock);
    tcp_conn **n = realloc(t->conns, (t->num_conns + 1) * sizeof(*n));
    if (!n) {
        pthread_rwlock_unlock(&t->lock);
        free(c);
        return tcp_err(-ENOMEM, "out of memory");
    }
    t->conns = n;
    t->conns[t->num_conns++] = c;
    c->id = t->num_conns;
    pthread_rwlock_unlock(&t->lock);
    tcp_conninfo info = {.magic = TCP_INFO_MAGIC, .version = TCP_VERSION, .node_id = t->base.node_id,
                         .port = t->port};
    memcpy(info.token, c->token, sizeof(info.token));
    snprintf(info.host, sizeof(info.host), "%s", t->host);
    memcpy(info_out, &info, sizeof(info));
    *info_len = sizeof(info);
    *conn_out = c->id;
    return 0;
}

/* Bind connection `id` to the token of its authenticated control session: the peer's streams
 * must present it (the random token of the info no longer opens this connection), and ours do.
 * Call it right after prepare(), before the info goes to the peer. */
/* Connection `id` while it may still take its session's secrets (prepared, no stream yet), or
 * NULL with the error in *rc. The caller holds t->lock for writing. */
static tcp_conn *prepared_conn(tcp_t *t, uint32_t id, const char *what, int *rc) {
    tcp_conn *c = tcp_conn_get(t, id);
    if (!c)
        *rc = tcp_err(-ENOENT, "unknown connection %u", id);
    else if (__atomic_load_n(&c->state, __ATOMIC_ACQUIRE) != CONN_PREPARED || c->streams)
        *rc = tcp_err(-EISCONN, "connection %u is already complete or dead: set its %s before complete()", id, what);
    else
        return c;
    return NULL;
}

int tcp_set_token(pdkv_transport *bt, uint32_t id, const void *token, uint32_t len) {
    tcp_t *t = (tcp_t *)bt;
    if (len < 16 || len > TCP_TOKEN_LEN)
        return tcp_err(-EINVAL, "a session token must be 16..%d bytes, got %u", TCP_TOKEN_LEN, len);
    pthread_rwlock_wrlock(&t->lock);
    int rc = 0;
    tcp_conn *c = prepared_conn(t, id, "token", &rc);
    if (c) {
        memset(c->token, 0, sizeof(c->token));
        memcpy(c->token, token, len);
        c->session = 1;
    }
    pthread_rwlock_unlock(&t->lock);
    return rc;
}

/* messenger.tls_data: every stream of connection `id` is sealed with keys derived from `key`
 * (TCP_DATA_KEY_LEN bytes both nodes derived from their control session). Before complete(). */
int tcp_set_data_key(pdkv_transport *bt, uint32_t id, const void *key, uint32_t len) {
    tcp_t *t = (tcp_t *)bt;
    if (!tcp_seal_available())
        return tcp_err(-ENOTSUP, "messenger.tls_data: pdkv was built without libcrypto (install libssl-dev and "
                                 "rebuild: make install)");
    if (len != TCP_DATA_KEY_LEN)
        return tcp_err(-EINVAL, "a data key must be %d bytes, got %u", TCP_DATA_KEY_LEN, len);
    pthread_rwlock_wrlock(&t->lock);
    int rc = 0;
    tcp_conn *c = prepared_conn(t, id, "data key", &rc);
    if (c) {
        memcpy(c->data_key, key, len);
        c->sealed = 1;
    }
    pthread_rwlock_unlock(&t->lock);
    return rc;
}

static int dial(const tcp_conninfo *info, char *why, size_t n) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST}, *res;
    char port[8];
    snprintf(port, sizeof(port), "%u", info->port);
    int rc = getaddrinfo(info->host, port, &hints, &res);
    if (rc) {
        snprintf(why, n, "bad peer address %s:%s: %s", info->host, port, gai_strerror(rc));
        return -EINVAL;
    }
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        freeaddrinfo(res);
        snprintf(why, n, "socket: %s", strerror(errno));
        return -errno;
    }
    tcp_sockopts(fd);
    struct timeval tv = {CONNECT_TIMEOUT_S, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (connect(fd, res->ai_addr, res->ai_addrlen) < 0) {
        int e = errno;
        freeaddrinfo(res);
        close(fd);
        snprintf(why, n, "connect to %s:%s: %s", info->host, port, strerror(e));
        return -e;
    }
    freeaddrinfo(res);
    return fd;
}

int tcp_complete(pdkv_transport *bt, uint32_t id, const void *blob, uint32_t blob_len) {
    tcp_t *t = (tcp_t *)bt;
    tcp_conninfo info;
    if (blob_len != sizeof(info)) return tcp_err(-EINVAL, "tcp connection info must be %zu bytes, got %u", sizeof(info), blob_len);
    memcpy(&info, blob, sizeof(info));
    if (info.magic != TCP_INFO_MAGIC || info.version != TCP_VERSION)
        return tcp_err(-EINVAL, "not tcp connection info (magic 0x%08x version %u)", info.magic, info.version);
    if (!memchr(info.host, 0, sizeof(info.host))) return tcp_err(-EINVAL, "connection info host is not terminated");
    pthread_rwlock_rdlock(&t->lock);
    tcp_conn *c = tcp_conn_get(t, id);
    pthread_rwlock_unlock(&t->lock);
    if (!c) return tcp_err(-ENOENT, "unknown connection %u", id);
    if (info.node_id != c->peer)
        return tcp_err(-EINVAL, "connection info is from node %llu, connection %u is for peer %llu",
                       (unsigned long long)info.node_id, id, (unsigned long long)c->peer);
    pthread_mutex_lock(&c->mu);
    if (c->state != CONN_PREPARED || c->streams) {
        pthread_mutex_unlock(&c->mu);
        return tcp_err(-EISCONN, "connection %u is already complete or dead", id);
    }
    tcp_stream *ss = calloc(c->num_streams, sizeof(*ss));
    if (!ss) {
        pthread_mutex_unlock(&c->mu);
        return tcp_err(-ENOMEM, "out of memory");
    }
    char why[PDKV_ERR_MAX]; /* what complete() raises: the peer's refusal is up to TCP_MAX_REASON */
    int rc = 0;
    uint32_t i;
    for (i = 0; i < c->num_streams; i++) {
        tcp_stream *s = &ss[i];
        s->t = t;
        s->conn = c;
        s->wake_fd = -1;
        pthread_mutex_init(&s->mu, NULL);
        s->fd = dial(&info, why, sizeof(why));
        if (s->fd < 0) {
            rc = s->fd;
            break;
        }
        tcp_hello h = {.magic = TCP_HELLO_MAGIC, .version = TCP_VERSION, .node_id = t->base.node_id,
                       .stream = i, .num_streams = c->num_streams};
        /* a session token is never sent in the info: both ends were given it */
        memcpy(h.token, c->session ? c->token : info.token, sizeof(h.token));
        tcp_frame ack;
        int r = tcp_send_all(s->fd, &h, sizeof(h));
        if (r > 0) r = tcp_recv_all(s->fd, &ack, sizeof(ack));
        if (r > 0 && (tcp_frame_parse(&ack, &ack, why, sizeof(why)) < 0 || ack.type != TCP_FR_ACK)) r = -EPROTO;
        if (r > 0 && ack.len) {
            char msg[TCP_MAX_REASON + 1] = {0};
            tcp_recv_all(s->fd, msg, ack.len);
            snprintf(why, sizeof(why), "peer %llu refused the connection: %s", (unsigned long long)c->peer, msg);
            r = -ECONNREFUSED;
        } else if (r <= 0 && r != -EPROTO) {
            snprintf(why, sizeof(why), "handshake with peer %llu failed: %s", (unsigned long long)c->peer,
                     r == 0 ? "closed" : strerror(-r));
            r = r ? r : -ECONNRESET;
        }
        if (r < 0) {
            rc = r;
            close(s->fd);
            break;
        }
        struct timeval tv = {0, 0};
        setsockopt(s->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        setsockopt(s->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        if (c->sealed) {
            rc = tcp_seal_init(&s->seal, c->data_key, t->base.node_id, c->peer, i, 1, why, sizeof(why));
            s->scratch = rc ? NULL : malloc(TCP_SEAL_CHUNK + sizeof(tcp_frame) + 2 * TCP_TAG_LEN);
            if (!rc && !s->scratch) {
                snprintf(why, sizeof(why), "out of memory");
                rc = -ENOMEM;
            }
            if (rc) {
                close(s->fd);
                break;
            }
        }
        s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        s->qcap = 256;
        s->q = malloc(s->qcap * sizeof(*s->q));
        if (s->wake_fd < 0 || !s->q || pthread_create(&s->thread, NULL, tcp_tx_main, s) != 0) {
            snprintf(why, sizeof(why), "cannot start a sender thread");
            rc = -ENOMEM;
            close(s->fd);
            break;
        }
        s->started = 1;
    }
    if (rc < 0) {
        /* undo the streams that did start: they have nothing queued yet. Not under c->mu: a
         * starting sender that saw its socket close may be waiting for it in tcp_conn_fail
         * (which finds c->streams still NULL and leaves these alone). */
        pthread_mutex_unlock(&c->mu);
        for (uint32_t j = 0; j <= i && j < c->num_streams; j++) {
            tcp_stream *s = &ss[j];
            if (s->started) {
                pthread_mutex_lock(&s->mu);
                s->dead = 1;
                shutdown(s->fd, SHUT_RDWR);
                pthread_mutex_unlock(&s->mu);
                uint64_t one = 1;
                ssize_t w = write(s->wake_fd, &one, sizeof(one));
                (void)w;
                pthread_join(s->thread, NULL);
            }
            if (s->wake_fd >= 0) close(s->wake_fd);
            free(s->q);
            free(s->scratch);
            tcp_seal_free(&s->seal);
            pthread_mutex_destroy(&s->mu);
        }
        free(ss);
        return tcp_err(rc, "%s", why);
    }
    c->streams = ss;
    __atomic_store_n(&c->state, CONN_CONNECTED, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

void tcp_conn_free(tcp_t *t, tcp_conn *c) {
    tcp_conn_fail(t, c, 0, "disconnected");
    tcp_rx_stop(t, c->id, 0);
    for (uint32_t i = 0; c->streams && i < c->num_streams; i++) {
        tcp_stream *s = &c->streams[i];
        if (s->started) pthread_join(s->thread, NULL);
        if (s->fd >= 0) close(s->fd);
        if (s->wake_fd >= 0) close(s->wake_fd);
        free(s->q);
        free(s->scratch);
        tcp_seal_free(&s->seal);
        pthread_mutex_destroy(&s->mu);
    }
    free(c->streams);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

int tcp_disconnect(pdkv_transport *bt, uint32_t id) {
    tcp_t *t = (tcp_t *)bt;
    pthread_rwlock_wrlock(&t->lock);
    tcp_conn *c = tcp_conn_get(t, id);
    if (c) t->conns[id - 1] = NULL;
    pthread_rwlock_unlock(&t->lock);
    if (!c) return tcp_err(-ENOENT, "unknown connection %u", id);
    tcp_conn_free(t, c);
    return 0;
}
