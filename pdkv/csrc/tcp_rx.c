/* tcp transport: one receiver thread per incoming stream, started by the listener
 * (tcp_accept.c) only after the stream's hello carried a valid token.
 *
 * A receiver loops: read a 40-byte header, check it (magic, check word, type), check
 * that the key exists, is granted to this peer and that [off, off+len) lies inside the region,
 * and only then receive the payload straight into the region. Anything wrong: an ERROR
 * completion here, an ERROR frame to the writer, and the stream is closed without writing a byte.
 *
 * NOTE: the region stays pinned while its payload is being received, so dereg() is -EBUSY then.
 * Payload reads use readv([rest of payload, next header]) so a stream of small pages costs about
 * one syscall per page instead of two.
 *
 * A sealed stream (tls_data, tcp_seal.c) carries each frame as a header record and a payload
 * record: the header is decrypted and its tag checked before anything is looked up; the payload
 * is decrypted into the granted range chunk by chunk and counted (its imm) only once its tag
 * checked. A record that fails its tag breaks the stream; what it left in the range is as
 * undefined as a torn RDMA write, and the request it was for never completes. A plain BYE at a
 * record boundary (the writer's teardown, sent by any thread) ends the stream quietly.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

#include "tcp_internal.h"

static int quiet(tcp_rx *rx) {
    return __atomic_load_n(&rx->stopping, __ATOMIC_ACQUIRE) || __atomic_load_n(&rx->t->stopping, __ATOMIC_ACQUIRE);
}

/* Report locally and tell the writer, then let the caller close. */
static void reject(tcp_rx *rx, int status, uint32_t imm, const char *reason) {
    tcp_t *t = rx->t;
    pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, 0, rx->peer, 0, status, imm, "from peer %llu: %s",
                  (unsigned long long)rx->peer, reason);
    tcp_frame f;
    size_t n = strlen(reason);
    tcp_frame_make(&f, TCP_FR_ERROR, 0, 0, n, 0, 0);
    /* best effort, never blocks: the writer may be stuck sending to us */
    struct iovec iov[2] = {{&f, sizeof(f)}, {(void *)reason, n}};
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2};
    ssize_t r = sendmsg(rx->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)r;
}

/* Parses a write frame's header and pins its destination (the key must be this peer's and the
 * range inside it). 0: *dst / *ticket hold the pinned bytes; 1: the stream ends here (BYE, or
 * the frame was refused: reject() has said why -- the imm names the request it hit). */
static int take_frame(tcp_rx *rx, const void *header, tcp_frame *f, uint8_t **dst, uint64_t *ticket) {
    tcp_t *t = rx->t;
    char why[PDKV_REASON_MAX];
    int rc = tcp_frame_parse(header, f, why, sizeof(why));
    if (rc == 0 && f->type == TCP_FR_BYE) return 1;
    if (rc == 0 && f->type != TCP_FR_DATA) {
        snprintf(why, sizeof(why), "unexpected frame type %u on a write stream", f->type);
        rc = -EPROTO;
    }
    if (rc == 0)
        rc = pdkv_regions_pin_remote(&t->regions, f->key, rx->peer, f->off, f->len, dst, ticket, why, sizeof(why));
    if (rc < 0) {
        if (rc != -EPROTO) __atomic_add_fetch(&t->refused_writes, 1, __ATOMIC_RELAXED);
        reject(rx, rc, rc == -EPROTO ? 0 : f->imm, why);
        return 1;
    }
    return 0;
}

static void frames(tcp_rx *rx) {
    tcp_t *t = rx->t;
    uint8_t hb[sizeof(tcp_frame)];
    size_t have = 0;
    for (;;) {
        while (have < sizeof(hb)) {
            ssize_t r = recv(rx->fd, hb + have, sizeof(hb) - have, 0);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                if (quiet(rx)) return;
                if (have)
                    pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, 0, rx->peer, 0, -EPROTO, 0,
                                  "peer %llu: truncated frame header (%zu of %zu bytes)",
                                  (unsigned long long)rx->peer, have, sizeof(hb));
                else
                    pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, 0, rx->peer, 0, -ECONNRESET, 0,
                                  "peer %llu closed the connection%s", (unsigned long long)rx->peer,
                                  r < 0 ? " (reset)" : "");
                return;
            }
            have += (size_t)r;
        }
        tcp_frame f;
        uint8_t *dst = NULL;
        uint64_t ticket = 0;
        if (take_frame(rx, hb, &f, &dst, &ticket)) return;
        uint64_t got = 0;
        have = 0;
        while (got < f.len) {
            struct iovec iov[2] = {{dst + got, f.len - got}, {hb, sizeof(hb)}};
            ssize_t r = readv(rx->fd, iov, 2);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                pdkv_regions_unpin_remote(&t->regions, f.key, rx->peer, ticket);
                if (!quiet(rx))
                    pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, 0, rx->peer, f.len, -ECONNRESET, f.imm,
                                  "peer %llu disconnected mid-write (%llu of %llu bytes into key 0x%llx)",
                                  (unsigned long long)rx->peer, (unsigned long long)got,
                                  (unsigned long long)f.len, (unsigned long long)f.key);
                return;
            }
            if ((uint64_t)r <= f.len - got) {
                got += (uint64_t)r;
            } else {
                have = (size_t)((uint64_t)r - (f.len - got));
                got = f.len;
            }
        }
        pdkv_regions_unpin_remote(&t->regions, f.key, rx->peer, ticket);
        if (f.flags & TCP_FL_IMM)
            pdkv_cq_pushf(&t->cq, PDKV_CQ_IMM, 0, rx->peer, f.len, 0, f.imm, NULL);
    }
}

static int sealed_record(tcp_rx *rx, uint8_t *out, const uint8_t *in, size_t len, uint8_t *tag) {
    return tcp_seal_begin(&rx->seal) || tcp_seal_update(&rx->seal, out, in, len) || tcp_seal_end(&rx->seal, tag);
}

static void closed(tcp_rx *rx, int r, const char *what) {
    if (quiet(rx)) return;
    pdkv_cq_pushf(&rx->t->cq, PDKV_CQ_ERROR, 0, rx->peer, 0, r < 0 ? r : -ECONNRESET, 0,
                  "peer %llu closed the connection%s", (unsigned long long)rx->peer, what);
}

static void frames_sealed(tcp_rx *rx) {
    tcp_t *t = rx->t;
    uint8_t rec[sizeof(tcp_frame) + TCP_TAG_LEN];
    char why[PDKV_REASON_MAX];
    static const char *forged = "a data record failed its authentication check (altered, injected, or not "
                                "sealed with this connection's key): dropping the stream";
    for (;;) {
        tcp_frame f;
        int r = tcp_recv_all(rx->fd, rec, sizeof(tcp_frame));
        if (r <= 0) {
            closed(rx, r, "");
            return;
        }
        if (tcp_frame_parse(rec, &f, why, sizeof(why)) == 0 && f.type == TCP_FR_BYE) return;
        if ((r = tcp_recv_all(rx->fd, rec + sizeof(tcp_frame), TCP_TAG_LEN)) <= 0) {
            closed(rx, r, " in the middle of a record");
            return;
        }
        if (sealed_record(rx, (uint8_t *)&f, rec, sizeof(tcp_frame), rec + sizeof(tcp_frame))) {
            reject(rx, -EPROTO, 0, forged);
            return;
        }
        uint8_t *dst = NULL;
        uint64_t ticket = 0;
        if (take_frame(rx, &f, &f, &dst, &ticket)) return;
        int ok = !f.len || tcp_seal_begin(&rx->seal) == 0;
        for (uint64_t got = 0; ok && got < f.len;) {
            size_t chunk = f.len - got < TCP_SEAL_CHUNK ? (size_t)(f.len - got) : TCP_SEAL_CHUNK;
            r = tcp_recv_all(rx->fd, rx->scratch, chunk);
            ok = r > 0 && tcp_seal_update(&rx->seal, dst + got, rx->scratch, chunk) == 0;
            got += chunk;
        }
        uint8_t tag[TCP_TAG_LEN];
        if (ok && f.len) ok = (r = tcp_recv_all(rx->fd, tag, sizeof(tag))) > 0 && tcp_seal_end(&rx->seal, tag) == 0;
        pdkv_regions_unpin_remote(&t->regions, f.key, rx->peer, ticket);
        if (!ok && r <= 0) {
            closed(rx, r, " in the middle of a write");
            return;
        }
        if (!ok) {
            reject(rx, -EPROTO, 0, forged);
            return;
        }
        if (f.flags & TCP_FL_IMM)
            pdkv_cq_pushf(&t->cq, PDKV_CQ_IMM, 0, rx->peer, f.len, 0, f.imm, NULL);
    }
}

static void *rx_main(void *arg) {
    tcp_rx *rx = arg;
    if (rx->sealed)
        frames_sealed(rx);
    else
        frames(rx);
    tcp_seal_free(&rx->seal);
    free(rx->scratch);
    rx->scratch = NULL;
    pthread_mutex_lock(&rx->t->rxmu);
    if (rx->fd >= 0) {
        shutdown(rx->fd, SHUT_RDWR);
        close(rx->fd);
        rx->fd = -1;
    }
    rx->done = 1;
    pthread_mutex_unlock(&rx->t->rxmu);
    __atomic_sub_fetch(&rx->t->rx_threads, 1, __ATOMIC_RELAXED);
    return NULL;
}

/* Join receivers that ended on their own (caller holds rxmu). */
static void reap(tcp_t *t) {
    for (tcp_rx **p = &t->rx; *p;) {
        tcp_rx *rx = *p;
        if (rx->done) {
            *p = rx->next;
            pthread_join(rx->thread, NULL);
            free(rx);
        } else {
            p = &rx->next;
        }
    }
}

void tcp_rx_stop(tcp_t *t, uint32_t conn, int all) {
    tcp_rx *mine = NULL;
    pthread_mutex_lock(&t->rxmu);
    for (tcp_rx **p = &t->rx; *p;) {
        tcp_rx *rx = *p;
        if (all || rx->conn == conn) {
            *p = rx->next;
            __atomic_store_n(&rx->stopping, 1, __ATOMIC_RELEASE);
            if (rx->fd >= 0) shutdown(rx->fd, SHUT_RDWR);
            rx->next = mine;
            mine = rx;
        } else {
            p = &rx->next;
        }
    }
    pthread_mutex_unlock(&t->rxmu);
    while (mine) {
        tcp_rx *rx = mine;
        mine = rx->next;
        pthread_join(rx->thread, NULL); /* it closes its own fd */
        free(rx);
    }
}

int tcp_rx_start(tcp_t *t, int fd, uint64_t peer, uint32_t conn, uint32_t stream, const uint8_t *data_key) {
    tcp_rx *rx = calloc(1, sizeof(*rx));
    if (!rx) return -ENOMEM;
    rx->t = t;
    rx->fd = fd;
    rx->peer = peer;
    rx->conn = conn;
    if (data_key) {
        char why[PDKV_REASON_MAX];
        rx->sealed = 1;
        if (tcp_seal_init(&rx->seal, data_key, peer, t->base.node_id, stream, 0, why, sizeof(why)) < 0 ||
            !(rx->scratch = malloc(TCP_SEAL_CHUNK))) {
            tcp_seal_free(&rx->seal);
            free(rx);
            return -ENOMEM;
        }
    }
    pthread_mutex_lock(&t->rxmu);
    reap(t);
    __atomic_add_fetch(&t->rx_threads, 1, __ATOMIC_RELAXED);
    int rc = pthread_create(&rx->thread, NULL, rx_main, rx);
    if (rc) {
        __atomic_sub_fetch(&t->rx_threads, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&t->rxmu);
        tcp_seal_free(&rx->seal);
        free(rx->scratch);
        free(rx);
        return -rc;
    }
    rx->next = t->rx;
    t->rx = rx;
    pthread_mutex_unlock(&t->rxmu);
    return 0;
}
