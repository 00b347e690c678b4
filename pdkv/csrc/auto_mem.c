/* auto transport: regions registered with both transports, grants through the one carrying
 * the peer (auto_internal.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auto_internal.h"

__thread char pdkv_auto_err[PDKV_ERR_MAX];

int pdkv_auto_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pdkv_auto_err, sizeof pdkv_auto_err, fmt, ap);
    va_end(ap);
    return code;
}

/* a sub-transport's failure, its own message kept */
int pdkv_auto_sub_fail(pdkv_transport *s, int rc) { return pdkv_auto_fail(rc, "%s", s->ops->last_error(s)); }

static auto_region *region_of(auto_t *t, uint64_t key) {
    for (uint32_t i = 0; i < t->num_regions; i++)
        if (t->regions[i].key == key) return &t->regions[i];
    return NULL;
}

uint64_t pdkv_auto_skey(auto_t *t, uint64_t key) {
    pthread_mutex_lock(&t->mu);
    auto_region *r = region_of(t, key);
    uint64_t s = r ? r->skey : 0;
    pthread_mutex_unlock(&t->mu);
    return s;
}

/* the link carrying peer now: its latest completed one (NULL: none, so tcp) */
static auto_conn *link_of(auto_t *t, uint64_t peer) {
    auto_conn *c = NULL;
    pthread_mutex_lock(&t->mu);
    for (uint32_t i = t->num_conns; i-- > 0 && !c;)
        if (t->conns[i]->peer == peer && t->conns[i]->via != VIA_NONE && !t->conns[i]->closed) c = t->conns[i];
    pthread_mutex_unlock(&t->mu);
    return c;
}

/* An shm grant to the peer of c failed (it could not map it, or stopped answering and its shm
 * connection was dropped): the link goes over to tcp for good, and the node is told why. */
static void fall_back(auto_t *t, auto_conn *c, uint64_t peer) {
    char why[PDKV_REASON_MAX];
    snprintf(why, sizeof why, "%s", pdkv_auto_err);
    pthread_mutex_lock(&t->mu);
    c->via = VIA_TCP;
    snprintf(c->why, sizeof c->why, "%s", why);
    pthread_mutex_unlock(&t->mu);
    pdkv_cq_pushf(&t->notes, PDKV_CQ_ERROR, 0, peer, 0, -EHOSTUNREACH, 0,
                  "auto: grants to peer %llu go through tcp from now on: %s", (unsigned long long)peer, why);
}

auto_conn *pdkv_auto_conn(auto_t *t, uint32_t id) {
    pthread_mutex_lock(&t->mu);
    auto_conn *c = id >= 1 && id <= t->num_conns ? t->conns[id - 1] : NULL;
    pthread_mutex_unlock(&t->mu);
    return c;
}

/* ---- memory ---- */

static int reg_as(auto_t *t, void *addr, uint64_t len, uint64_t *key, int source) {
    uint64_t skey = 0;
    /* shm first: it remaps the pages in place, so tcp's registration sees the shared memory */
    int (*reg)(pdkv_transport *, void *, uint64_t, uint64_t *) = source ? t->shm->ops->reg_source : t->shm->ops->reg;
    if (reg(t->shm, addr, len, &skey) < 0) {
        skey = 0; /* this region goes through tcp to every peer; said once in route(0) */
        pthread_mutex_lock(&t->mu);
        if (!t->reg_note[0])
            snprintf(t->reg_note, sizeof t->reg_note, "%s", t->shm->ops->last_error(t->shm));
        pthread_mutex_unlock(&t->mu);
    }
    int rc = t->tcp->ops->reg(t->tcp, addr, len, key);
    if (rc < 0) {
        rc = pdkv_auto_sub_fail(t->tcp, rc);
        if (skey) t->shm->ops->dereg(t->shm, skey);
        return rc;
    }
    pthread_mutex_lock(&t->mu);
    if (t->num_regions == AUTO_MAX_REGIONS) {
        pthread_mutex_unlock(&t->mu);
        t->tcp->ops->dereg(t->tcp, *key);
        if (skey) t->shm->ops->dereg(t->shm, skey);
        return pdkv_auto_fail(-ENOSPC, "auto transport: at most %d regions", AUTO_MAX_REGIONS);
    }
    t->regions[t->num_regions++] = (auto_region){*key, skey, source};
    pthread_mutex_unlock(&t->mu);
    return 0;
}

int pdkv_auto_reg(pdkv_transport *bt, void *addr, uint64_t len, uint64_t *key) {
    return reg_as((auto_t *)bt, addr, len, key, 0);
}

/* Written from through either link, granted through neither: no peer maps it, so shm leaves
 * its pages private (see transport.h's reg_source). */
int pdkv_auto_reg_source(pdkv_transport *bt, void *addr, uint64_t len, uint64_t *key) {
    return reg_as((auto_t *)bt, addr, len, key, 1);
}

int pdkv_auto_dereg(pdkv_transport *bt, uint64_t key) {
    auto_t *t = (auto_t *)bt;
    uint64_t skey = pdkv_auto_skey(t, key);
    int rc = t->tcp->ops->dereg(t->tcp, key);
    if (rc < 0) return pdkv_auto_sub_fail(t->tcp, rc); /* -EBUSY: a write still lands; both keep it */
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
    uint64_t skey = pdkv_auto_skey(t, key), k = 0;
    int rc;
    pthread_mutex_lock(&t->mu);
    auto_region *r = region_of(t, key);
    int source = r && r->source;
    pthread_mutex_unlock(&t->mu);
    if (source)
        return pdkv_auto_fail(-EPERM, "auto: region 0x%llx was registered as a write source only: it cannot be "
                              "granted to a peer", (unsigned long long)key);
    auto_conn *c = skey ? link_of(t, peer) : NULL;
    if (c && c->via == VIA_SHM) {
        rc = whole ? t->shm->ops->grant(t->shm, skey, peer, &k)
                   : t->shm->ops->grant_range(t->shm, skey, peer, off, len, &k);
        if (rc < 0 && rc != -EEXIST && rc != -ENOSPC) { /* not the grant's own fault: tcp takes it */
            pdkv_auto_sub_fail(t->shm, rc);
            fall_back(t, c, peer);
        } else if (rc < 0) {
            return pdkv_auto_sub_fail(t->shm, rc);
        }
    }
    if (c && c->via == VIA_SHM) {
        if (whole && (rc = t->tcp->ops->grant(t->tcp, key, peer, NULL)) < 0) {
            rc = pdkv_auto_sub_fail(t->tcp, rc);
            t->shm->ops->revoke(t->shm, skey, peer);
            return rc;
        }
        if (out) *out = k | SHM_TAG;
        return 0;
    }
    rc = whole ? t->tcp->ops->grant(t->tcp, key, peer, &k) : t->tcp->ops->grant_range(t->tcp, key, peer, off, len, &k);
    if (rc < 0) return pdkv_auto_sub_fail(t->tcp, rc);
    if (out) *out = k;
    return 0;
}

/* Revoked wherever it was granted (the peer's route may have changed since: a redial). */
static int revoke_both(auto_t *t, uint64_t key, uint64_t peer, int whole, uint64_t off, uint64_t len) {
    uint64_t skey = pdkv_auto_skey(t, key);
    int rs = -ENOENT, rt;
    char why[PDKV_ERR_MAX] = "";
    if (skey) {
        rs = whole ? t->shm->ops->revoke(t->shm, skey, peer) : t->shm->ops->revoke_range(t->shm, skey, peer, off, len);
        if (rs < 0) snprintf(why, sizeof why, "%s", t->shm->ops->last_error(t->shm));
    }
    rt = whole ? t->tcp->ops->revoke(t->tcp, key, peer) : t->tcp->ops->revoke_range(t->tcp, key, peer, off, len);
    if (rt < 0 && rt != -ENOENT) return pdkv_auto_sub_fail(t->tcp, rt);
    if (rs < 0 && rs != -ENOENT) return pdkv_auto_fail(rs, "%s", why);
    if (rt == -ENOENT && rs == -ENOENT) return pdkv_auto_sub_fail(t->tcp, rt);
    return 0;
}

int pdkv_auto_grant(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t *out) {
    return grant_via((auto_t *)bt, k, p, 1, 0, 0, out);
}
int pdkv_auto_revoke(pdkv_transport *bt, uint64_t k, uint64_t p) { return revoke_both((auto_t *)bt, k, p, 1, 0, 0); }
int pdkv_auto_grant_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len, uint64_t *out) {
    return grant_via((auto_t *)bt, k, p, 0, off, len, out);
}
int pdkv_auto_revoke_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len) {
    return revoke_both((auto_t *)bt, k, p, 0, off, len);
}
