/* pdkv libfabric transport: the connections the core sees, each one endpoint pair per (local
 * device, remote device) its writes can use -- every pair, or (prepare_pairs) only those the
 * layer above says its writes use: with 8 devices on both sides and rank r's pages on device r,
 * 8 endpoints instead of 64 (the verbs transport's queue-pair pairs, verbs_multi_conn.c).
 *
 * Info blob (fb_info): the header, one fb_info_pair per prepared pair (its endpoint's name),
 * then the region table (provider keys). Both sides prepare before they see the other's blob;
 * complete() connects our pair (i, j) with the peer's (j, i) when both prepared it, drops the
 * pairs the peer did not prepare or toward devices it does not have, and fails when none is
 * left. Without pairs, every (i, j) with j below our own device count is prepared: hosts with
 * different device counts name their pairs (the node does, from both placements).
 *
 * A write goes on the pair of its local key's device and its remote key's device; a pair that
 * was not made is refused, naming it (a write the caller did not plan for is a bug to see, not
 * to reroute). Every write of a post is checked before any is accepted.
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Called with t->mu held: every endpoint pair of l is dropped (their writes fail). */
void fb_drop_link(fb_transport *t, fb_link *l, const char *why)
{
    for (uint32_t i = 0; i < FB_MAX_DEVS; i++)
        for (uint32_t j = 0; j < FB_MAX_DEVS; j++)
            if (l->cid[i][j])
                fb_drop_conn(t, &t->conns[l->cid[i][j] - 1], why);
    memset(l, 0, sizeof *l);
}

static int prepare(fb_transport *t, uint64_t peer, const uint8_t *pairs, void *info_out,
                   uint32_t *info_len, uint32_t *conn_out)
{
    uint32_t num_pairs = 0;
    for (uint32_t i = 0; pairs && i < FB_MAX_DEVS; i++)
        for (uint32_t j = 0; j < FB_MAX_DEVS; j++) {
            if (pairs[i * PDKV_MAX_NICS + j] && i >= t->num_devs)
                return fb_fail(-EINVAL, "libfabric: endpoint pair (local domain %u, remote domain "
                                        "%u) asked for: this transport has %u domains", i, j,
                               t->num_devs);
            num_pairs += pairs[i * PDKV_MAX_NICS + j] != 0;
        }
    if (pairs && !num_pairs)
        return fb_fail(-EINVAL, "libfabric: a connection needs at least one (local domain, "
                                "remote domain) endpoint pair");
    if (!pairs)
        num_pairs = t->num_devs * t->num_devs;
    pthread_mutex_lock(&t->mu);
    uint64_t total = sizeof(fb_info) + (uint64_t)num_pairs * sizeof(fb_info_pair) +
                     (t->table ? t->num_regions : 0) * 8ull;
    uint32_t li = 0;
    while (li < FB_MAX_LINKS && t->links[li].used)
        li++;
    int rc = 0;
    if (total > PDKV_INFO_MAX)
        rc = fb_fail(-E2BIG, "libfabric: %u endpoint pairs need a %llu-byte connection info "
                             "(limit %d)", num_pairs, (unsigned long long)total, PDKV_INFO_MAX);
    else if (li == FB_MAX_LINKS)
        rc = fb_fail(-ENOSPC, "libfabric: too many connections (%d)", FB_MAX_LINKS);
    if (rc) {
        pthread_mutex_unlock(&t->mu);
        return rc;
    }
    fb_link *l = &t->links[li];
    memset(l, 0, sizeof *l);
    l->used = 1, l->peer = peer;
    fb_info info = {.magic = FB_INFO_MAGIC, .version = FB_INFO_VERSION, .node_id = t->base.node_id,
                    .flags = (t->virt ? FB_INFO_VIRT : 0) | (t->table ? FB_INFO_TABLE : 0),
                    .num_devs = t->num_devs};
    snprintf(info.provider, sizeof info.provider, "%s", t->provider);
    fb_info_pair *out = (fb_info_pair *)((char *)info_out + sizeof info);
    for (uint32_t i = 0; !rc && i < t->num_devs; i++)
        for (uint32_t j = 0; !rc && j < (pairs ? FB_MAX_DEVS : t->num_devs); j++) {
            if (pairs && !pairs[i * PDKV_MAX_NICS + j])
                continue;
            uint32_t ci;
            rc = fb_conn_open(t, peer, i, j, &ci);
            if (!rc) {
                l->cid[i][j] = (uint16_t)(ci + 1);
                t->conns[ci].link = li;
                rc = fb_conn_name(t, &t->conns[ci], &out[info.num_pairs++]);
            }
        }
    if (rc) {
        char why[PDKV_REASON_MAX];
        snprintf(why, sizeof why, "%s", fb_errbuf());
        fb_drop_link(t, l, "prepare failed");
        fb_fail(rc, "%s", why);
    } else {
        /* provider keys: the writer aims through our regions' addresses */
        uint64_t *table = (uint64_t *)(out + info.num_pairs);
        for (uint32_t k = 0; t->table && k < t->num_regions; k++)
            table[k] = t->regions[k].key ? (uint64_t)(uintptr_t)t->regions[k].addr : 0;
        info.num_regions = t->table ? t->num_regions : 0;
        memcpy(info_out, &info, sizeof info);
        *info_len = (uint32_t)(sizeof info + info.num_pairs * sizeof(fb_info_pair) +
                               info.num_regions * sizeof(uint64_t));
        *conn_out = li;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int fb_prepare(pdkv_transport *t, uint64_t peer, void *info_out, uint32_t *info_len,
               uint32_t *conn_out)
{
    return prepare((fb_transport *)t, peer, NULL, info_out, info_len, conn_out);
}

int fb_prepare_pairs(pdkv_transport *t, uint64_t peer, const uint8_t *pairs, void *info_out,
                     uint32_t *info_len, uint32_t *conn_out)
{
    return prepare((fb_transport *)t, peer, pairs, info_out, info_len, conn_out);
}

static int check_info(const fb_info *info, uint32_t len)
{
    if (info->magic != FB_INFO_MAGIC || info->version != FB_INFO_VERSION)
        return fb_fail(-EPROTO, "libfabric: connection info has magic 0x%x version %u, expected "
                                "0x%x version %u", info->magic, info->version, FB_INFO_MAGIC,
                       FB_INFO_VERSION);
    if (info->num_regions > FB_MAX_REGIONS || info->num_pairs > FB_MAX_DEVS * FB_MAX_DEVS ||
        len != sizeof *info + info->num_pairs * sizeof(fb_info_pair) + info->num_regions * 8ull)
        return fb_fail(-EINVAL, "libfabric: connection info of %u bytes for %u endpoint pairs "
                                "and %u regions", len, info->num_pairs, info->num_regions);
    return 0;
}

/* The peer's endpoint for our pair (i, j): its pair (j, i), or NULL. */
static const fb_info_pair *peer_pair(const fb_info *info, const fb_info_pair *p, uint32_t i,
                                     uint32_t j)
{
    for (uint32_t k = 0; k < info->num_pairs; k++)
        if (p[k].dev == j && p[k].rdev == i)
            return &p[k];
    return NULL;
}

int fb_complete(pdkv_transport *base, uint32_t conn, const void *blob, uint32_t len)
{
    fb_transport *t = (fb_transport *)base;
    fb_info info;
    if (len < sizeof info)
        return fb_fail(-EINVAL, "libfabric: connection info of %u bytes, expected at least %zu "
                                "(not from a libfabric transport of this version?)", len,
                       sizeof info);
    memcpy(&info, blob, sizeof info);
    int rc = check_info(&info, len);
    if (rc)
        return rc;
    info.provider[sizeof info.provider - 1] = 0;
    const fb_info_pair *pairs = (const fb_info_pair *)((const char *)blob + sizeof info);
    const uint64_t *table = (const uint64_t *)(pairs + info.num_pairs);
    pthread_mutex_lock(&t->mu);
    fb_link *l = conn < FB_MAX_LINKS && t->links[conn].used ? &t->links[conn] : NULL;
    if (!l)
        rc = fb_fail(-ENOENT, "libfabric: unknown connection %u", conn);
    else if (l->ready)
        rc = fb_fail(-EISCONN, "libfabric: connection %u is complete already", conn);
    else if (info.node_id != l->peer)
        rc = fb_fail(-EPROTO, "libfabric: connection %u was prepared for peer %llu, the info is "
                              "from node %llu", conn, (unsigned long long)l->peer,
                     (unsigned long long)info.node_id);
    else if (strcmp(info.provider, t->provider))
        rc = fb_fail(-EPROTO, "libfabric: peer %llu runs provider '%s', this node '%s'",
                     (unsigned long long)l->peer, info.provider, t->provider);
    uint32_t made = 0;
    for (uint32_t i = 0; !rc && i < FB_MAX_DEVS; i++)
        for (uint32_t j = 0; !rc && j < FB_MAX_DEVS; j++) {
            if (!l->cid[i][j])
                continue;
            fb_conn *c = &t->conns[l->cid[i][j] - 1];
            const fb_info_pair *p = j < info.num_devs ? peer_pair(&info, pairs, i, j) : NULL;
            if (!p) { /* the peer did not prepare it (or has no device j): not made */
                fb_drop_conn(t, c, "the peer prepared no endpoint for this pair");
                l->cid[i][j] = 0;
                continue;
            }
            if ((rc = fb_conn_connect(t, c, p)))
                break;
            c->peer_virt = !!(info.flags & FB_INFO_VIRT);
            if (info.flags & FB_INFO_TABLE) {
                c->peer_table = malloc(info.num_regions * sizeof(uint64_t) + 1);
                if (!c->peer_table)
                    rc = fb_fail(-ENOMEM, "libfabric: out of memory");
                else
                    memcpy(c->peer_table, table, info.num_regions * 8ull);
                c->peer_table_n = info.num_regions;
            }
            made++;
        }
    if (!rc && !made)
        rc = fb_fail(-EPROTO, "libfabric: peer %llu prepared no endpoint pair this connection "
                              "prepared (it has %u domains, this node %u)",
                     (unsigned long long)l->peer, info.num_devs, t->num_devs);
    if (!rc) {
        l->peer_table = !!(info.flags & FB_INFO_TABLE);
        l->ready = 1;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int fb_disconnect(pdkv_transport *base, uint32_t conn)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    int rc = 0;
    if (conn >= FB_MAX_LINKS || !t->links[conn].used)
        rc = fb_fail(-ENOENT, "libfabric: unknown connection %u", conn);
    else
        fb_drop_link(t, &t->links[conn], "disconnected");
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* The endpoint pair write w goes on (the devices of its keys), or an error + fb_fail naming why. */
static int route(fb_transport *t, fb_link *l, const pdkv_write *w, int k, fb_conn **out)
{
    uint32_t i = FB_KEY_DEV(w->lkey);
    uint32_t j = l->peer_table && (w->rkey & FB_TABLE_FLAG) ? FB_TKEY_DEV(w->rkey)
                                                            : FB_KEY_DEV(w->rkey);
    uint32_t ci = i < FB_MAX_DEVS ? l->cid[i][j] : 0;
    if (!ci || !t->conns[ci - 1].ready)
        return fb_fail(-EINVAL, "libfabric: write %d: no endpoint pair from domain %s to remote "
                                "domain %u of peer %llu (remote key 0x%llx)", k,
                i < t->num_devs ? t->dev[i].name : "?", j, (unsigned long long)l->peer,
                (unsigned long long)w->rkey);
    fb_conn *c = &t->conns[ci - 1];
    if (c->broken)
        return fb_fail(-ECONNRESET, "libfabric: connection %u to peer %llu is broken (the "
                                    "endpoint pair from %s to remote domain %u)", c->link,
                       (unsigned long long)l->peer, t->dev[i].name, j);
    *out = c;
    return 0;
}

/* Every write is checked and routed, and every pair's backlog has room, before any is
 * accepted; then each run of consecutive writes on one pair enters that pair's backlog in the
 * caller's order. */
int fb_post(pdkv_transport *base, uint32_t conn, const pdkv_write *w, int n)
{
    fb_transport *t = (fb_transport *)base;
    if (n <= 0)
        return n ? fb_fail(-EINVAL, "libfabric: negative write count") : 0;
    fb_conn **to = calloc((size_t)n, sizeof *to);
    if (!to)
        return fb_fail(-ENOMEM, "libfabric: out of memory for %d writes", n);
    pthread_mutex_lock(&t->mu);
    fb_link *l = conn < FB_MAX_LINKS && t->links[conn].used ? &t->links[conn] : NULL;
    int rc = 0;
    if (!l || !l->ready)
        rc = fb_fail(-ENOTCONN, "libfabric: connection %u is not connected", conn);
    else
        rc = fb_check_writes(t, w, n);
    for (int k = 0; !rc && k < n; k++)
        rc = route(t, l, &w[k], k, &to[k]);
    for (int k = 0; !rc && k < n; k++)
        to[k]->post_need++; /* each pair's total (t->mu is held: the field is this call's) */
    for (int k = 0; !rc && k < n; k++)
        if (to[k]->post_need && fb_reserve(to[k], to[k]->post_need))
            rc = fb_fail(-ENOMEM, "libfabric: out of memory");
        else
            to[k]->post_need = 0;
    for (int k = 0; rc && k < n && to[0]; k++)
        if (to[k])
            to[k]->post_need = 0;
    for (int k = 0, start = 0; !rc && k < n; k++)
        if (k + 1 == n || to[k + 1] != to[start]) {
            fb_enqueue(t, to[start], &w[start], k + 1 - start);
            start = k + 1;
        }
    pthread_mutex_unlock(&t->mu);
    free(to);
    return rc ? rc : n;
}
#endif /* PDKV_HAVE_LIBFABRIC */
