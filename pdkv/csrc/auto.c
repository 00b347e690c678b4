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
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "auto_internal.h"

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
    int first = (t->poll_turn++ & 1) ? VIA_SHM : VIA_TCP; /* neither starves the other */
    int got = pdkv_cq_poll(&t->notes, out, max);
    for (int k = 0; k < 2 && got < max; k++) {
        int via = k == 0 ? first : VIA_SHM + VIA_TCP - first;
        pdkv_transport *s = via == VIA_SHM ? t->shm : t->tcp;
        int n = s->ops->poll(s, out + got, max - got);
        if (n > 0) count(t, via, out + got, n), got += n;
    }
    return got;
}

static int a_event_fd(pdkv_transport *bt) { return ((auto_t *)bt)->efd; }

/* The core waits on one fd: the relay turns either sub-transport's (or our notes') ring-not-empty
 * edge into ours. NOTE: it resets a sub's fd before ringing ours, so a push after the reset rings again. */
static void *relay(void *arg) {
    auto_t *t = arg;
    struct pollfd pf[4] = {{t->stop_fd, POLLIN, 0}, {t->notes.efd, POLLIN, 0},
                           {t->tcp->ops->event_fd(t->tcp), POLLIN, 0}, {t->shm->ops->event_fd(t->shm), POLLIN, 0}};
    for (;;) {
        if (poll(pf, 4, -1) < 0) continue;
        if (pf[0].revents) return NULL;
        uint64_t v = 1;
        for (int i = 1; i < 4; i++)
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
    return pdkv_auto_err;
}

static void a_counters(pdkv_transport *bt, pdkv_transport_counters *out) {
    auto_t *t = (auto_t *)bt;
    pdkv_transport_counters a = {0}, b = {0};
    t->tcp->ops->counters(t->tcp, &a);
    t->shm->ops->counters(t->shm, &b);
    out->copied_writes = b.copied_writes, out->copied_bytes = b.copied_bytes; /* shm's alone */
    out->shared_writes = b.shared_writes;
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

/* The shared hand-off (kv_handoff: share) on a link auto routed through shm: shm's own, under
 * shm's keys; a link (or a grant) that went through tcp has nothing to share. */
static int a_share_pages(pdkv_transport *bt, uint32_t id, uint64_t lkey, uint64_t loff, uint64_t rkey,
                         uint64_t roff, uint64_t len) {
    auto_t *t = (auto_t *)bt;
    auto_conn *c = pdkv_auto_conn(t, id);
    if (!c) return pdkv_auto_fail(-ENOENT, "unknown auto connection %u", id);
    pthread_mutex_lock(&t->mu);
    uint32_t sconn = c->sconn;
    pthread_mutex_unlock(&t->mu);
    if (!(rkey & SHM_TAG) || !sconn)
        return pdkv_auto_fail(-EOPNOTSUPP, "share_pages: peer %llu's grant went through tcp: "
                              "nothing to share", (unsigned long long)c->peer);
    uint64_t skey = pdkv_auto_skey(t, lkey);
    if (!skey)
        return pdkv_auto_fail(-EINVAL, "share_pages: local region 0x%llx is not shared (shm could not "
                              "register it: %s)", (unsigned long long)lkey, t->reg_note);
    int rc = t->shm->ops->share_pages(t->shm, sconn, skey, loff, rkey & ~SHM_TAG, roff, len);
    return rc < 0 ? pdkv_auto_sub_fail(t->shm, rc) : rc;
}

static int a_unshare_pages(pdkv_transport *bt, uint32_t id, uint64_t lkey, uint64_t loff, uint64_t len) {
    auto_t *t = (auto_t *)bt;
    auto_conn *c = pdkv_auto_conn(t, id);
    if (!c) return 0; /* as shm: a range not shared (any more) is no error */
    pthread_mutex_lock(&t->mu);
    uint32_t sconn = c->sconn;
    pthread_mutex_unlock(&t->mu);
    uint64_t skey = pdkv_auto_skey(t, lkey);
    if (!sconn || !skey) return 0;
    int rc = t->shm->ops->unshare_pages(t->shm, sconn, skey, loff, len);
    return rc < 0 ? pdkv_auto_sub_fail(t->shm, rc) : rc;
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
    if (t->notes_ok) pdkv_cq_destroy(&t->notes);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static const pdkv_transport_ops auto_ops = {
    .name = "auto", .reg = pdkv_auto_reg, .grant = pdkv_auto_grant, .revoke = pdkv_auto_revoke,
    .grant_range = pdkv_auto_grant_range, .revoke_range = pdkv_auto_revoke_range, .dereg = pdkv_auto_dereg,
    .prepare = pdkv_auto_prepare, .complete = pdkv_auto_complete,
    .set_token = pdkv_auto_set_token, .disconnect = pdkv_auto_disconnect, .post = pdkv_auto_post, .poll = a_poll,
    .event_fd = a_event_fd, .last_error = a_last_error, .counters = a_counters, .destroy = a_destroy,
    .nic_stats = a_nic_stats, .same_host = pdkv_auto_same_host, .route = pdkv_auto_route,
    .share_pages = a_share_pages, .unshare_pages = a_unshare_pages, .reg_source = pdkv_auto_reg_source,
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
    int rc = pdkv_cq_init(&t->notes);
    t->notes_ok = rc == 0;
    if (rc < 0) {
        snprintf(err, errlen, "auto: completion queue: %s", strerror(-rc));
    } else if (!(t->tcp = pdkv_tcp_create(node_id, &opts->tcp, sub, sizeof sub))) {
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
