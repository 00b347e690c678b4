/* auto transport: links (tcp always, shm when the handshake found the peer on this host) and
 * writes, each through the transport its remote key names (auto_internal.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auto_internal.h"

/* ---- connections ---- */

int pdkv_auto_same_host(pdkv_transport *bt, uint64_t peer, int yes) {
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

int pdkv_auto_prepare(pdkv_transport *bt, uint64_t peer, void *info, uint32_t *len, uint32_t *conn) {
    auto_t *t = (auto_t *)bt;
    uint8_t *p = info;
    auto_info h = {.magic = AUTO_INFO_MAGIC};
    uint32_t tconn = 0, sconn = 0, n = 0;
    char why[PDKV_REASON_MAX] = "the control handshake did not find the peer on this host";
    int rc = t->tcp->ops->prepare(t->tcp, peer, p + sizeof h, &n, &tconn);
    if (rc < 0) return pdkv_auto_sub_fail(t->tcp, rc);
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
        return pdkv_auto_fail(-ENOMEM, "auto transport: out of memory for a connection");
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

int pdkv_auto_set_token(pdkv_transport *bt, uint32_t id, const void *tok, uint32_t len) {
    auto_t *t = (auto_t *)bt;
    auto_conn *c = pdkv_auto_conn(t, id);
    if (!c) return pdkv_auto_fail(-EINVAL, "auto connection %u is not prepared", id);
    int rc = t->tcp->ops->set_token(t->tcp, c->tconn, tok, len);
    if (rc < 0) return pdkv_auto_sub_fail(t->tcp, rc);
    if (c->sconn && (rc = t->shm->ops->set_token(t->shm, c->sconn, tok, len)) < 0)
        return pdkv_auto_sub_fail(t->shm, rc);
    return 0;
}

int pdkv_auto_complete(pdkv_transport *bt, uint32_t id, const void *info, uint32_t len) {
    auto_t *t = (auto_t *)bt;
    auto_conn *c = pdkv_auto_conn(t, id);
    auto_info h;
    const uint8_t *p = info;
    if (!c || c->via != VIA_NONE) return pdkv_auto_fail(-EINVAL, "auto connection %u is not prepared", id);
    if (len < sizeof h)
        return pdkv_auto_fail(-EINVAL, "auto connection info must be at least %zu bytes, got %u", sizeof h, len);
    memcpy(&h, p, sizeof h);
    if (h.magic != AUTO_INFO_MAGIC)
        return pdkv_auto_fail(-EINVAL, "not auto connection info (is the peer on another transport?)");
    if ((uint64_t)h.tcp_len + h.shm_len != len - sizeof h)
        return pdkv_auto_fail(-EINVAL, "auto connection info: %u + %u bytes announced, %zu came", h.tcp_len,
                              h.shm_len, len - sizeof h);
    int rc = t->tcp->ops->complete(t->tcp, c->tconn, p + sizeof h, h.tcp_len);
    if (rc < 0) return pdkv_auto_sub_fail(t->tcp, rc);
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

int pdkv_auto_disconnect(pdkv_transport *bt, uint32_t id) {
    auto_t *t = (auto_t *)bt;
    auto_conn *c = pdkv_auto_conn(t, id);
    if (!c) return pdkv_auto_fail(-ENOENT, "unknown auto connection %u", id);
    pthread_mutex_lock(&t->mu);
    uint32_t tconn = c->tconn, sconn = c->sconn;
    c->closed = 1, c->sconn = 0;
    pthread_mutex_unlock(&t->mu);
    if (sconn) t->shm->ops->disconnect(t->shm, sconn);
    int rc = t->tcp->ops->disconnect(t->tcp, tconn);
    return rc < 0 ? pdkv_auto_sub_fail(t->tcp, rc) : 0;
}

const char *pdkv_auto_route(pdkv_transport *bt, uint32_t id, char *why, size_t n) {
    auto_t *t = (auto_t *)bt;
    const char *name = NULL;
    auto_conn *c = pdkv_auto_conn(t, id);
    pthread_mutex_lock(&t->mu);
    if (!id) snprintf(why, n, "%s", t->reg_note);
    else if (c) name = c->via == VIA_SHM ? "shm" : "tcp", snprintf(why, n, "%s", c->via == VIA_SHM ? "" : c->why);
    else snprintf(why, n, "unknown auto connection %u", id);
    pthread_mutex_unlock(&t->mu);
    return name;
}

/* ---- writes: each through the transport its remote key names ---- */

int pdkv_auto_post(pdkv_transport *bt, uint32_t id, const pdkv_write *w, int n) {
    auto_t *t = (auto_t *)bt;
    if (n <= 0) return 0;
    auto_conn *c = pdkv_auto_conn(t, id);
    if (!c) return pdkv_auto_fail(-ENOENT, "unknown auto connection %u", id);
    pthread_mutex_lock(&t->mu);
    uint32_t tconn = c->tconn, sconn = c->sconn;
    pthread_mutex_unlock(&t->mu);
    int shm = (w[0].rkey & SHM_TAG) != 0;
    for (int i = 1; i < n; i++)
        if (((w[i].rkey & SHM_TAG) != 0) != shm)
            return pdkv_auto_fail(-EINVAL, "a batch to peer %llu mixes shm-granted and tcp-granted keys",
                        (unsigned long long)c->peer);
    uint64_t bytes = 0;
    for (int i = 0; i < n; i++) bytes += w[i].len;
    int rc;
    if (!shm) {
        if ((rc = t->tcp->ops->post(t->tcp, tconn, w, n)) < 0) return pdkv_auto_sub_fail(t->tcp, rc);
    } else if (!sconn) {
        return pdkv_auto_fail(-ENOTCONN, "peer %llu granted through shm, but our shm connection to it is not up",
                    (unsigned long long)c->peer);
    } else {
        pdkv_write stack[POST_STACK], *x = n <= POST_STACK ? stack : malloc((size_t)n * sizeof *x);
        if (!x) return pdkv_auto_fail(-ENOMEM, "out of memory");
        uint64_t lkey = 0, skey = 0;
        rc = 0;
        for (int i = 0; i < n && !rc; i++) {
            x[i] = w[i];
            x[i].rkey &= ~SHM_TAG;
            if (i == 0 || w[i].lkey != lkey) lkey = w[i].lkey, skey = pdkv_auto_skey(t, lkey);
            if (!skey)
                rc = pdkv_auto_fail(-EINVAL, "local region 0x%llx is not shared (shm could not register it: %s)",
                                 (unsigned long long)lkey, t->reg_note);
            x[i].lkey = skey;
        }
        if (!rc && (rc = t->shm->ops->post(t->shm, sconn, x, n)) < 0) rc = pdkv_auto_sub_fail(t->shm, rc);
        if (x != stack) free(x);
        if (rc < 0) return rc;
    }
    pthread_mutex_lock(&t->mu);
    t->via[shm ? VIA_SHM : VIA_TCP].writes += (uint64_t)rc;
    t->via[shm ? VIA_SHM : VIA_TCP].bytes += bytes;
    pthread_mutex_unlock(&t->mu);
    return rc;
}
