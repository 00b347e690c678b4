/* tcp transport, connection table: lookups and marking a connection dead.
 * Called by the set-up code (tcp_conn.c), the receivers (tcp_rx.c) and the senders (tcp_tx.c);
 * calls only the leaves (tcp_net.c, cq.c). */
#define _GNU_SOURCE
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tcp_internal.h"

tcp_conn *tcp_conn_get(tcp_t *t, uint32_t id) { /* caller holds t->lock */
    return (id >= 1 && id <= t->num_conns) ? t->conns[id - 1] : NULL;
}

/* Compares every byte whatever the first difference: no timing hint about a secret token. */
static int same_token(const uint8_t *a, const uint8_t *b) {
    uint8_t d = 0;
    for (int i = 0; i < TCP_TOKEN_LEN; i++) d |= a[i] ^ b[i];
    return d == 0;
}

tcp_conn *tcp_conn_by_token(tcp_t *t, uint64_t peer, const uint8_t *token) {
    for (uint32_t i = 0; i < t->num_conns; i++) {
        tcp_conn *c = t->conns[i];
        if (c && c->peer == peer && same_token(c->token, token) &&
            __atomic_load_n(&c->state, __ATOMIC_ACQUIRE) != CONN_DEAD)
            return c;
    }
    return NULL;
}

/* Mark a connection dead once (first reason wins) and wake its senders so they fail their queues. */
void tcp_conn_fail(tcp_t *t, tcp_conn *c, int status, const char *reason) {
    pthread_mutex_lock(&c->mu); /* waits for a complete() in progress: streams are then set */
    int was = c->state;
    tcp_stream *streams = c->streams;
    if (was != CONN_DEAD) {
        snprintf(c->reason, sizeof(c->reason), "%s", reason);
        __atomic_store_n(&c->state, CONN_DEAD, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&c->mu);
    if (was == CONN_DEAD) return;
    if (status) pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, 0, c->peer, 0, status, 0, "%s", reason);
    for (uint32_t i = 0; streams && i < c->num_streams; i++) { /* none if never completed */
        tcp_stream *s = &streams[i];
        pthread_mutex_lock(&s->mu);
        s->dead = 1;
        if (s->fd >= 0) {
            tcp_frame bye;
            tcp_frame_make(&bye, TCP_FR_BYE, 0, 0, 0, 0, 0);
            ssize_t r = send(s->fd, &bye, sizeof(bye), MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)r;
            shutdown(s->fd, SHUT_RDWR);
        }
        pthread_mutex_unlock(&s->mu);
        uint64_t one = 1;
        if (s->wake_fd >= 0) {
            ssize_t r = write(s->wake_fd, &one, sizeof(one));
            (void)r;
        }
    }
}
