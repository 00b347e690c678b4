/* auto: shm to a peer on this host, tcp to any other (see auto.h).
 *
 * Why two transports per node: a node makes its transport at start, before any handshake tells
 * it where its peers run, and its KV pool must be registered before then. So both are made and
 * every region is registered with both (shm first: it moves the pages onto a shared file in
 * place, and tcp then registers the same addresses). Each connection prepares tcp always and
 * shm when the HELLOs named one host; complete() keeps shm when its own checks pass (boot id,
 * the peer's socket reachable) and falls back to tcp otherwise, saying why (route()).
 *
 * Agreement without another round trip: only the owner's grants decide where a peer may write.
 * The owner grants through the transport that carries the peer, and an shm grant's key is
 * tagged (SHM_TAG), so the writer posts every write through the transport its key names; a
 * peer that took shm while the owner fell back to tcp just writes through tcp. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "auto.h"

#define AUTO_INFO_MAGIC 0x4f545541u /* "AUTO" */
#define SHM_TAG (1ull << 63)         /* regions.c keys never set it */
#define AUTO_MAX_REGIONS 1024
#define AUTO_MAX_HINTS 256
#define POST_STACK 64

enum { VIA_NONE = 0, VIA_TCP = 1, VIA_SHM = 2 };

typedef struct auto_info { uint32_t magic, tcp_len, shm_len, pad; } auto_info;
typedef struct auto_region { uint64_t key, skey; } auto_region; /* key: tcp's (ours); skey 0: tcp only */
typedef struct auto_conn {
    uint64_t peer;
    uint32_t tconn, sconn; /* 0: none */
    int via;               /* VIA_NONE until complete() */
    int closed;            /* disconnected: carries nothing now */
    char why[PDKV_REASON_MAX];
} auto_conn;
typedef struct auto_route_stats { uint64_t writes, bytes, writes_done, bytes_done, errors, imms, imm_bytes; } auto_route_stats;

typedef struct auto_t {
    pdkv_transport base;
    pdkv_transport *tcp, *shm;
    pthread_mutex_t mu; /* regions, conns, hints, stats */
    auto_region regions[AUTO_MAX_REGIONS];
    uint32_t num_regions;
    auto_conn **conns; /* grows as links come (each stays where it is: pointers are kept) */
    uint32_t num_conns;
    struct { uint64_t peer; int yes; } hints[AUTO_MAX_HINTS];
    uint32_t num_hints;
    auto_route_stats via[3];
    char reg_note[PDKV_REASON_MAX]; /* the first region shm could not share */
    int efd, stop_fd;               /* ours (the core waits on it), and the relay's stop */
    pthread_t relay;
    int relay_running;
    uint32_t poll_turn;
} auto_t;

static __thread char tls_err[PDKV_ERR_MAX];

static int aerr(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof tls_err, fmt, ap);
    va_end(ap);
    return code;
}

/* a sub-transport's failure, its own message kept */
static int sub_err(pdkv_transport *s, int rc) { return aerr(rc, "%s", s->ops->last_error(s)); }

static auto_region *region_of(auto_t *t, uint64_t key) {
    for (uint32_t i = 0; i < t->num_regions; i++)
        if (t->regions[i].key == key) return &t->regions[i];
    return NULL;
}

static uint64_t skey_of(auto_t *t, uint64_t key) {
    pthread_mutex_lock(&t->mu);
    auto_region *r = region_of(t, key);
    uint64_t s = r ? r->skey : 0;
    pthread_mutex_unlock(&t->mu);
    return s;
}

/* the transport carrying peer now: its latest completed connection's */
static int via_peer(auto_t *t, uint64_t peer) {
    int via = VIA_TCP;
    pthread_mutex_lock(&t->mu);
    for (uint32_t i = t->num_conns; i-- > 0;)
        if (t->conns[i]->peer == peer && t->conns[i]->via != VIA_NONE && !t->conns[i]->closed) {
            via = t->conns[i]->via;
            break;
        }
    pthread_mutex_unlock(&t->mu);
    return via;
}

static auto_conn *conn_of(auto_t *t, uint32_t id) {
    pthread_mutex_lock(&t->mu);
    auto_conn *c = id >= 1 && id <= t->num_conns ? t->conns[id - 1] : NULL;
    pthread_mutex_unlock(&t->mu);
    return c;
}

/* ---- memory ---- */

static int a_reg(pdkv_transport *bt, void *addr, uint64_t len, uint64_t *key) {
    auto_t *t = (auto_t *)bt;
    uint64_t skey = 0;
    /* shm first: it remaps the pages in place, so tcp's registration sees the shared memory */
    if (t->shm->ops->reg(t->shm, addr, len, &skey) < 0) {
        skey = 0; /* this region goes through tcp to every peer; said once in route(0) */
        pthread_mutex_lock(&t->mu);
        if (!t->reg_note[0])
            snprintf(t->reg_note, sizeof t->reg_note, "%s", t->shm->ops->last_error(t->shm));
        pthread_mutex_unlock(&t->mu);
    }
    int rc = t->tcp->ops->reg(t->tcp, addr, len, key);
    if (rc < 0) {
        rc = sub_err(t->tcp, rc);
        if (skey) t->shm->ops->dereg(t->shm, skey);
        return rc;
    }
    pthread_mutex_lock(&t->mu);
    if (t->num_regions == AUTO_MAX_REGIONS) {
        pthread_mutex_unlock(&t->mu);
        t->tcp->ops->dereg(t->tcp, *key);
        if (skey) t->shm->ops->dereg(t->shm, skey);
        return aerr(-ENOSPC, "auto transport: at most %d regions", AUTO_MAX_REGIONS);
    }
    t->regions[t->num_regions++] = (auto_region){*key, skey};
    pthread_mutex_unlock(&t->mu);
    return 0;
}

static int a_dereg(pdkv_transport *bt, uint64_t key) {
    auto_t *t = (auto_t *)bt;
    uint64_t skey = skey_of(t, key);
    int rc = t->tcp->ops->dereg(t->tcp, key);
    if (rc < 0) return sub_err(t->tcp, rc); /* -EBUSY: a write still lands; both keep it */
    if (skey) t->shm->ops->dereg(t->shm, skey); /* shm has nothing in flight once post() returned */
    pthread_mutex_lock(&t->mu);
    auto_region *r = region_of(t, key);
    if (r) *r = t->regions[--t->num_regions];
    pthread_mutex_unlock(&t->mu);
    return 0;
}

/* A grant through the transport carrying the peer. A whole-region grant to an shm peer is made
 * on tcp too: a writer naming the region key itself (untagged) writes through tcp. */
static int grant_via(auto_t *t, uint64_t key, uint64_t peer, int whole, uint64_t off, uint64_t len, uint64_t *out) {
    uint64_t skey = skey_of(t, key), k = 0;
    int rc;
    if (skey && via_peer(t, peer) == VIA_SHM) {
        rc = whole ? t->shm->ops->grant(t->shm, skey, peer, &k)
                   : t->shm->ops->grant_range(t->shm, skey, peer, off, len, &k);
        if (rc < 0) return sub_err(t->shm, rc);
        if (whole && (rc = t->tcp->ops->grant(t->tcp, key, peer, NULL)) < 0) {
            rc = sub_err(t->tcp, rc);
            t->shm->ops->revoke(t->shm, skey, peer);
            return rc;
        }
        if (out) *out = k | SHM_TAG;
        return 0;
    }
    rc = whole ? t->tcp->ops->grant(t->tcp, key, peer, &k) : t->tcp->ops->grant_range(t->tcp, key, peer, off, len, &k);
    if (rc < 0) return sub_err(t->tcp, rc);
    if (out) *out = k;
    return 0;
}

/* Revoked wherever it was granted (the peer's route may have changed since: a redial). */
static int revoke_both(auto_t *t, uint64_t key, uint64_t peer, int whole, uint64_t off, uint64_t len) {
    uint64_t skey = skey_of(t, key);
    int rs = -ENOENT, rt;
    char why[PDKV_ERR_MAX] = "";
    if (skey) {
        rs = whole ? t->shm->ops->revoke(t->shm, skey, peer) : t->shm->ops->revoke_range(t->shm, skey, peer, off, len);
        if (rs < 0) snprintf(why, sizeof why, "%s", t->shm->ops->last_error(t->shm));
    }
    rt = whole ? t->tcp->ops->revoke(t->tcp, key, peer) : t->tcp->ops->revoke_range(t->tcp, key, peer, off, len);
    if (rt < 0 && rt != -ENOENT) return sub_err(t->tcp, rt);
    if (rs < 0 && rs != -ENOENT) return aerr(rs, "%s", why);
    if (rt == -ENOENT && rs == -ENOENT) return sub_err(t->tcp, rt);
    return 0;
}

static int a_grant(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t *out) {
    return grant_via((auto_t *)bt, k, p, 1, 0, 0, out);
}
static int a_revoke(pdkv_transport *bt, uint64_t k, uint64_t p) { return revoke_both((auto_t *)bt, k, p, 1, 0, 0); }
static int a_grant_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len, uint64_t *out) {
    return grant_via((auto_t *)bt, k, p, 0, off, len, out);
}
static int a_revoke_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len) {
    return revoke_both((auto_t *)bt, k, p, 0, off, len);
}

/* ---- connections ---- */

static int a_same_host(pdkv_transport *bt, uint64_t peer, int yes) {
    auto_t *t = (auto_t *)bt;
    pthread_mutex_lock(&t->mu);
    uint32_t i = 0;
    while (i < t->num_hints && t->hints[i].peer != peer) i++;
    if (i == t->num_hints) {
        if (t->num_hints == AUTO_MAX_HINTS) i = t->num_hints - 1; /* the oldest hints matter least */
        else t->num_hints++;
    }
    t->hints[i].peer = peer, t->hints[i].yes = yes;
    pthread_mutex_unlock(&t->mu);
    return 0;
}

static int a_prepare(pdkv_transport *bt, uint64_t peer, void *info, uint32_t *len, uint32_t *conn) {
    auto_t *t = (auto_t *)bt;
    uint8_t *p = info;
    auto_info h = {.magic = AUTO_INFO_MAGIC};
    uint32_t tconn = 0, sconn = 0, n = 0;
    char why[PDKV_REASON_MAX] = "the control handshake did not find the peer on this host";
    int rc = t->tcp->ops->prepare(t->tcp, peer, p + sizeof h, &n, &tconn);
    if (rc < 0) return sub_err(t->tcp, rc);
    h.tcp_len = n;
    int same = 0;
    pthread_mutex_lock(&t->mu);
    for (uint32_t i = 0; i < t->num_hints; i++)
        if (t->hints[i].peer == peer) same = t->hints[i].yes;
    pthread_mutex_unlock(&t->mu);
    if (same && sizeof h + h.tcp_len < PDKV_INFO_MAX - 512) {
        if (t->shm->ops->prepare(t->shm, peer, p + sizeof h + h.tcp_len, &n, &sconn) < 0)
            snprintf(why, sizeof why, "%s", t->shm->ops->last_error(t->shm)), sconn = 0;
        else
            h.shm_len = n;
    }
    auto_conn *c = calloc(1, sizeof *c);
    pthread_mutex_lock(&t->mu);
    auto_conn **grown = c ? realloc(t->conns, (t->num_conns + 1) * sizeof *grown) : NULL;
    if (!grown) {
        pthread_mutex_unlock(&t->mu);
        free(c);
        t->tcp->ops->disconnect(t->tcp, tconn);
        if (sconn) t->shm->ops->disconnect(t->shm, sconn);
        return aerr(-ENOMEM, "auto transport: out of memory for a connection");
    }
    t->conns = grown;
    *c = (auto_conn){.peer = peer, .tconn = tconn, .sconn = sconn, .via = VIA_NONE};
    snprintf(c->why, sizeof c->why, "%s", sconn ? "" : why);
    t->conns[t->num_conns] = c;
    *conn = ++t->num_conns;
    pthread_mutex_unlock(&t->mu);
    memcpy(p, &h, sizeof h);
    *len = (uint32_t)sizeof h + h.tcp_len + h.shm_len;
    return 0;
}

static int a_set_token(pdkv_transport *bt, uint32_t id, const void *tok, uint32_t len) {
    auto_t *t = (auto_t *)bt;
    auto_conn *c = conn_of(t, id);
    if (!c) return aerr(-EINVAL, "auto connection %u is not prepared", id);
    int rc = t->tcp->ops->set_token(t->tcp, c->tconn, tok, len);
    if (rc < 0) return sub_err(t->tcp, rc);
    if (c->sconn && (rc = t->shm->ops->set_token(t->shm, c->sconn, tok, len)) < 0) return sub_err(t->shm, rc);
    return 0;
}

static int a_complete(pdkv_transport *bt, uint32_t id, const void *info, uint32_t len) {
    auto_t *t = (auto_t *)bt;
    auto_conn *c = conn_of(t, id);
    auto_info h;
    const uint8_t *p = info;
    if (!c || c->via != VIA_NONE) return aerr(-EINVAL, "auto connection %u is not prepared", id);
    if (len < sizeof h) return aerr(-EINVAL, "auto connection info must be at least %zu bytes, got %u", sizeof h, len);
    memcpy(&h, p, sizeof h);
    if (h.magic != AUTO_INFO_MAGIC) return aerr(-EINVAL, "not auto connection info (is the peer on another transport?)");
    if ((uint64_t)h.tcp_len + h.shm_len != len - sizeof h)
        return aerr(-EINVAL, "auto connection info: %u + %u bytes announced, %zu came", h.tcp_len, h.shm_len,
                    len - sizeof h);
    int rc = t->tcp->ops->complete(t->tcp, c->tconn, p + sizeof h, h.tcp_len);
    if (rc < 0) return sub_err(t->tcp, rc);
    char why[PDKV_REASON_MAX];
    snprintf(why, sizeof why, "%s", c->why);
    int via = VIA_TCP;
    if (c->sconn && h.shm_len) {
        if (t->shm->ops->complete(t->shm, c->sconn, p + sizeof h + h.tcp_len, h.shm_len) == 0)
            via = VIA_SHM, why[0] = 0;
        else
            snprintf(why, sizeof why, "%s", t->shm->ops->last_error(t->shm));
    } else if (c->sconn) {
        snprintf(why, sizeof why, "the peer offered no shm connection (its handshake did not find us on its host)");
    }
    uint32_t drop = via != VIA_SHM ? c->sconn : 0;
    if (drop) t->shm->ops->disconnect(t->shm, drop);
    pthread_mutex_lock(&t->mu);
    if (drop) c->sconn = 0;
    c->via = via;
    snprintf(c->why, sizeof c->why, "%s", why);
    pthread_mutex_unlock(&t->mu);
    return 0;
}

static int a_disconnect(pdkv_transport *bt, uint32_t id) {
    auto_t *t = (auto_t *)bt;
    auto_conn *c = conn_of(t, id);
    if (!c) return aerr(-ENOENT, "unknown auto connection %u", id);
    pthread_mutex_lock(&t->mu);
    uint32_t tconn = c->tconn, sconn = c->sconn;
    c->closed = 1, c->sconn = 0;
    pthread_mutex_unlock(&t->mu);
    if (sconn) t->shm->ops->disconnect(t->shm, sconn);
    int rc = t->tcp->ops->disconnect(t->tcp, tconn);
    return rc < 0 ? sub_err(t->tcp, rc) : 0;
}

static const char *a_route(pdkv_transport *bt, uint32_t id, char *why, size_t n) {
    auto_t *t = (auto_t *)bt;
    const char *name = NULL;
    auto_conn *c = conn_of(t, id);
    pthread_mutex_lock(&t->mu);
    if (!id) snprintf(why, n, "%s", t->reg_note);
    else if (c) name = c->via == VIA_SHM ? "shm" : "tcp", snprintf(why, n, "%s", c->via == VIA_SHM ? "" : c->why);
    else snprintf(why, n, "unknown auto connection %u", id);
    pthread_mutex_unlock(&t->mu);
    return name;
}

/* ---- writes: each through the transport its remote key names ---- */

static int a_post(pdkv_transport *bt, uint32_t id, const pdkv_write *w, int n) {
    auto_t *t = (auto_t *)bt;
    if (n <= 0) return 0;
    auto_conn *c = conn_of(t, id);
    if (!c) return aerr(-ENOENT, "unknown auto connection %u", id);
    pthread_mutex_lock(&t->mu);
    uint32_t tconn = c->tconn, sconn = c->sconn;
    pthread_mutex_unlock(&t->mu);
    int shm = (w[0].rkey & SHM_TAG) != 0;
    for (int i = 1; i < n; i++)
        if (((w[i].rkey & SHM_TAG) != 0) != shm)
            return aerr(-EINVAL, "a batch to peer %llu mixes shm-granted and tcp-granted keys",
                        (unsigned long long)c->peer);
    uint64_t bytes = 0;
    for (int i = 0; i < n; i++) bytes += w[i].len;
    int rc;
    if (!shm) {
        if ((rc = t->tcp->ops->post(t->tcp, tconn, w, n)) < 0) return sub_err(t->tcp, rc);
    } else if (!sconn) {
        return aerr(-ENOTCONN, "peer %llu granted through shm, but our shm connection to it is not up",
                    (unsigned long long)c->peer);
    } else {
        pdkv_write stack[POST_STACK], *x = n <= POST_STACK ? stack : malloc((size_t)n * sizeof *x);
        if (!x) return aerr(-ENOMEM, "out of memory");
        uint64_t lkey = 0, skey = 0;
        rc = 0;
        for (int i = 0; i < n && !rc; i++) {
            x[i] = w[i];
            x[i].rkey &= ~SHM_TAG;
            if (i == 0 || w[i].lkey != lkey) lkey = w[i].lkey, skey = skey_of(t, lkey);
            if (!skey) rc = aerr(-EINVAL, "local region 0x%llx is not shared (shm could not register it: %s)",
                                 (unsigned long long)lkey, t->reg_note);
            x[i].lkey = skey;
        }
        if (!rc && (rc = t->shm->ops->post(t->shm, sconn, x, n)) < 0) rc = sub_err(t->shm, rc);
        if (x != stack) free(x);
        if (rc < 0) return rc;
    }
    pthread_mutex_lock(&t->mu);
    t->via[shm ? VIA_SHM : VIA_TCP].writes += (uint64_t)rc;
    t->via[shm ? VIA_SHM : VIA_TCP].bytes += bytes;
    pthread_mutex_unlock(&t->mu);
    return rc;
}

static void count(auto_t *t, int via, const pdkv_completion *cp, int n) {
    auto_route_stats *s = &t->via[via];
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < n; i++) {
        if (cp[i].kind == PDKV_CQ_IMM) s->imms++, s->imm_bytes += cp[i].len;
        else if (cp[i].kind == PDKV_CQ_WRITE_DONE) s->writes_done++, s->bytes_done += cp[i].len;
        else if (cp[i].wr_id) s->errors++;
    }
    pthread_mutex_unlock(&t->mu);
}

static int a_poll(pdkv_transport *bt, pdkv_completion *out, int max) {
    auto_t *t = (auto_t *)bt;
    int first = (t->poll_turn++ & 1) ? VIA_SHM : VIA_TCP, got = 0; /* neither starves the other */
    for (int k = 0; k < 2 && got < max; k++) {
        int via = k == 0 ? first : VIA_SHM + VIA_TCP - first;
        pdkv_transport *s = via == VIA_SHM ? t->shm : t->tcp;
        int n = s->ops->poll(s, out + got, max - got);
        if (n > 0) count(t, via, out + got, n), got += n;
    }
    return got;
}

static int a_event_fd(pdkv_transport *bt) { return ((auto_t *)bt)->efd; }

/* The core waits on one fd: the relay turns either sub-transport's ring-not-empty edge into
 * ours. NOTE: it resets a sub's fd before ringing ours, so a push after the reset rings again. */
static void *relay(void *arg) {
    auto_t *t = arg;
    struct pollfd pf[3] = {{t->stop_fd, POLLIN, 0}, {t->tcp->ops->event_fd(t->tcp), POLLIN, 0},
                           {t->shm->ops->event_fd(t->shm), POLLIN, 0}};
    for (;;) {
        if (poll(pf, 3, -1) < 0) continue;
        if (pf[0].revents) return NULL;
        uint64_t v = 1;
        for (int i = 1; i < 3; i++)
            if (pf[i].revents & POLLIN) {
                ssize_t r = read(pf[i].fd, &v, sizeof v);
                (void)r;
            }
        v = 1;
        ssize_t r = write(t->efd, &v, sizeof v);
        (void)r;
    }
}

static const char *a_last_error(pdkv_transport *bt) {
    (void)bt;
    return tls_err;
}

static void a_counters(pdkv_transport *bt, pdkv_transport_counters *out) {
    auto_t *t = (auto_t *)bt;
    pdkv_transport_counters a = {0}, b = {0};
    t->tcp->ops->counters(t->tcp, &a);
    t->shm->ops->counters(t->shm, &b);
    out->refused_writes = a.refused_writes + b.refused_writes;
    out->refused_conns = a.refused_conns + b.refused_conns;
    out->pending_conns = a.pending_conns + b.pending_conns;
    out->rx_threads = a.rx_threads + b.rx_threads;
}

/* What each route carried, as two "NICs" named shm and tcp (qps: connections it carries). */
static int a_nic_stats(pdkv_transport *bt, pdkv_nic_stats *out, int max) {
    auto_t *t = (auto_t *)bt;
    static const char *names[3] = {"", "tcp", "shm"};
    int k = 0;
    pthread_mutex_lock(&t->mu);
    for (int via = VIA_SHM; via >= VIA_TCP && k < max; via--, k++) {
        const auto_route_stats *s = &t->via[via];
        pdkv_nic_stats *o = &out[k];
        memset(o, 0, sizeof *o);
        snprintf(o->name, sizeof o->name, "%s", names[via]);
        o->writes = s->writes, o->bytes = s->bytes, o->writes_done = s->writes_done, o->bytes_done = s->bytes_done;
        o->errors = s->errors, o->imms = s->imms, o->imm_bytes = s->imm_bytes;
        for (uint32_t i = 0; i < t->num_conns; i++) o->qps += t->conns[i]->via == via && !t->conns[i]->closed;
    }
    pthread_mutex_unlock(&t->mu);
    return k;
}

static void a_destroy(pdkv_transport *bt) {
    auto_t *t = (auto_t *)bt;
    if (t->relay_running) {
        uint64_t v = 1;
        ssize_t r = write(t->stop_fd, &v, sizeof v);
        (void)r;
        pthread_join(t->relay, NULL);
    }
    if (t->shm) t->shm->ops->destroy(t->shm);
    if (t->tcp) t->tcp->ops->destroy(t->tcp);
    for (uint32_t i = 0; i < t->num_conns; i++) free(t->conns[i]);
    free(t->conns);
    if (t->efd >= 0) close(t->efd);
    if (t->stop_fd >= 0) close(t->stop_fd);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static const pdkv_transport_ops auto_ops = {
    .name = "auto", .reg = a_reg, .grant = a_grant, .revoke = a_revoke, .grant_range = a_grant_range,
    .revoke_range = a_revoke_range, .dereg = a_dereg, .prepare = a_prepare, .complete = a_complete,
    .set_token = a_set_token, .disconnect = a_disconnect, .post = a_post, .poll = a_poll,
    .event_fd = a_event_fd, .last_error = a_last_error, .counters = a_counters, .destroy = a_destroy,
    .nic_stats = a_nic_stats, .same_host = a_same_host, .route = a_route,
};

pdkv_transport *pdkv_auto_create(uint64_t node_id, const pdkv_auto_opts *opts, char *err, size_t errlen) {
    static const pdkv_auto_opts dflt = {.tcp = {.host = "127.0.0.1", .num_streams = 2}};
    auto_t *t = calloc(1, sizeof *t);
    if (!t) return snprintf(err, errlen, "out of memory"), NULL;
    opts = opts ? opts : &dflt;
    t->base.ops = &auto_ops, t->base.node_id = node_id;
    t->efd = t->stop_fd = -1;
    pthread_mutex_init(&t->mu, NULL);
    char sub[PDKV_ERR_MAX] = "";
    if (!(t->tcp = pdkv_tcp_create(node_id, &opts->tcp, sub, sizeof sub))) {
        snprintf(err, errlen, "auto: tcp: %s", sub);
    } else if (!(t->shm = pdkv_shm_create(node_id, &opts->shm, sub, sizeof sub))) {
        snprintf(err, errlen, "auto: shm: %s", sub);
    } else if ((t->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0 ||
               (t->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) {
        snprintf(err, errlen, "auto: eventfd: %s", strerror(errno));
    } else if (pthread_create(&t->relay, NULL, relay, t)) {
        snprintf(err, errlen, "auto: thread");
    } else {
        t->relay_running = 1;
        return &t->base;
    }
    a_destroy(&t->base);
    return NULL;
}
