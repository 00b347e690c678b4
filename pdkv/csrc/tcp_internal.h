/* Private state of the tcp transport, shared by tcp.c (set-up, post, vtable), tcp_conn.c
 * (connections), tcp_tx.c (one sender thread per outgoing stream), tcp_rx.c (listener + one
 * receiver thread per incoming stream) and the leaves tcp_state.c / tcp_net.c. Not part of the API. */
#ifndef PDKV_TCP_INTERNAL_H
#define PDKV_TCP_INTERNAL_H

#include <pthread.h>

#include "cq.h"
#include "regions.h"
#include "tcp_wire.h"
#include "transport.h"

#define TCP_DATA_KEY_LEN 32
#define TCP_TAG_LEN 16
#define TCP_SEAL_CHUNK (256u << 10) /* bytes encrypted or decrypted per scratch buffer */

/* One direction of a sealed stream (tcp_seal.c): its AES-256-GCM key and record counter. */
typedef struct tcp_seal {
    void *ctx; /* EVP_CIPHER_CTX */
    uint8_t key[32];
    uint64_t seq;
    int encrypt;
} tcp_seal;

typedef struct tcp_op {
    tcp_frame hdr; /* prebuilt DATA header */
    const uint8_t *src;
    uint64_t lkey, wr_id;
} tcp_op;

struct tcp_conn;
struct tcp_t;

typedef struct tcp_stream {
    struct tcp_t *t;
    struct tcp_conn *conn;
    int fd; /* -1 once closed; changed under mu */
    pthread_t thread;
    int started;
    pthread_mutex_t mu; /* queue, fd, dead, sleeping */
    tcp_op *q;
    uint32_t qcap, qhead, qcount;
    int wake_fd;
    int sleeping, dead;
    uint64_t queued_bytes; /* atomic: picks the least loaded stream */
    tcp_seal seal;    /* sealed connections (set_data_key): this stream's records */
    uint8_t *scratch; /* sealed: TCP_SEAL_CHUNK + a header record + a tag */
} tcp_stream;

enum { CONN_PREPARED = 1, CONN_CONNECTED = 2, CONN_DEAD = 3 };

typedef struct tcp_conn {
    uint32_t id;
    uint64_t peer;
    uint8_t token[TCP_TOKEN_LEN]; /* what the peer's hello must carry (and ours carries, if session) */
    int session;                  /* token given by the control session (set_token) */
    int sealed;                   /* tls_data: every stream encrypted and authenticated */
    uint8_t data_key[TCP_DATA_KEY_LEN]; /* sealed: both nodes' key for this connection */
    int state; /* atomic */
    uint32_t num_streams;
    tcp_stream *streams;
    /* incoming: the stream count the peer's first accepted hello said, and the indices accepted
     * (each once); read and written by the listener thread alone */
    uint32_t rx_num_streams;
    uint64_t rx_streams_seen;
    pthread_mutex_t mu; /* state transitions, reason */
    char reason[PDKV_REASON_MAX];
} tcp_conn;

typedef struct tcp_rx {
    struct tcp_t *t;
    int fd; /* -1 once closed; changed under t->rxmu */
    pthread_t thread;
    uint64_t peer;
    uint32_t conn;
    int done, stopping;
    int sealed;
    tcp_seal seal;
    uint8_t *scratch;
    struct tcp_rx *next;
} tcp_rx;

typedef struct tcp_t {
    pdkv_transport base;
    uint32_t num_streams;
    uint32_t handshake_ms, max_pending, max_per_source; /* listener bounds (tcp_accept.c) */
    char host[64];
    uint16_t port;
    int lfd, stop_fd;
    pthread_t listener;
    int listener_started;
    int stopping; /* atomic */
    pthread_rwlock_t lock; /* conns[] */
    tcp_conn **conns;
    uint32_t num_conns;
    pthread_mutex_t rxmu; /* rx list */
    tcp_rx *rx;
    pdkv_regions regions;
    pdkv_cq cq;
    uint64_t refused_writes, refused_conns, pending_conns, rx_threads; /* atomic counters */
} tcp_t;

/* Call order (each file calls only files below it):
 *   tcp.c (function table) -> tcp_accept.c (listener, handshakes) -> tcp_conn.c (set-up,
 *   teardown) -> tcp_rx.c (receivers), tcp_tx.c (senders) -> tcp_state.c (connection table)
 *   -> tcp_net.c (errors, socket I/O), tcp_seal.c (sealed streams). */
/* tcp_seal.c (leaf): sealed streams; without libcrypto every call fails, naming it */
int tcp_seal_init(tcp_seal *s, const uint8_t *data_key, uint64_t writer, uint64_t reader, uint32_t stream,
                  int encrypt, char *why, size_t n);
void tcp_seal_free(tcp_seal *s);
int tcp_seal_begin(tcp_seal *s); /* a new record: the next nonce */
int tcp_seal_update(tcp_seal *s, uint8_t *out, const uint8_t *in, size_t len);
int tcp_seal_end(tcp_seal *s, uint8_t tag[TCP_TAG_LEN]); /* encrypt: writes the tag; decrypt: checks it */
int tcp_seal_available(void);
/* tcp_net.c */
int tcp_err(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
char *tcp_errbuf(void); /* this thread's last reason, PDKV_ERR_MAX bytes */
void tcp_sockopts(int fd);
int tcp_send_all(int fd, const void *buf, size_t len);
int tcp_recv_all(int fd, void *buf, size_t len);
/* tcp_state.c */
tcp_conn *tcp_conn_get(tcp_t *t, uint32_t id);                        /* caller holds t->lock */
tcp_conn *tcp_conn_by_token(tcp_t *t, uint64_t peer, const uint8_t *token); /* caller holds t->lock */
void tcp_conn_fail(tcp_t *t, tcp_conn *c, int status, const char *reason);
/* tcp_conn.c */
int tcp_prepare(pdkv_transport *bt, uint64_t peer, void *info_out, uint32_t *info_len, uint32_t *conn_out);
int tcp_complete(pdkv_transport *bt, uint32_t id, const void *blob, uint32_t blob_len);
int tcp_disconnect(pdkv_transport *bt, uint32_t id);
int tcp_set_token(pdkv_transport *bt, uint32_t id, const void *token, uint32_t len);
int tcp_set_data_key(pdkv_transport *bt, uint32_t id, const void *key, uint32_t len);
void tcp_conn_free(tcp_t *t, tcp_conn *c); /* fail, stop its receivers, join its senders, free */
/* tcp_tx.c */
void *tcp_tx_main(void *arg);
/* tcp_accept.c */
void *tcp_listener_main(void *arg);
/* tcp_rx.c: a receiver for an accepted stream (data_key: NULL, or its connection's: sealed) */
int tcp_rx_start(tcp_t *t, int fd, uint64_t peer, uint32_t conn, uint32_t stream, const uint8_t *data_key);
void tcp_rx_stop(tcp_t *t, uint32_t conn, int all); /* shut down + join receivers */

#endif
