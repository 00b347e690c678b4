/* pdkv libfabric transport: connections. Each is an RDM endpoint of its own (with its AV and CQ)
 * in the peer's domain: prepare() opens it and returns its name (fi_getname) in the info blob,
 * which travels over the messenger's authenticated control channel; complete() inserts the
 * peer's name into the AV (fi_av_insert) -- from then on writes go to that address. Dropping a
 * connection closes its endpoint, after which nothing of it can land or complete, so its
 * outstanding writes are failed at once (the same rule as the verbs transport's QPs).
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int fb_prepare(pdkv_transport *base, uint64_t peer, void *info_out, uint32_t *info_len,
               uint32_t *conn_out)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    int rc = 0;
    uint32_t i = 0;
    while (i < FB_MAX_CONNS && t->conns[i].used)
        i++;
    fb_conn *c = i < FB_MAX_CONNS ? &t->conns[i] : NULL;
    fb_domain *d = c ? fb_domain_get(t, peer, 1) : NULL;
    if (!c) {
        rc = fb_fail(-ENOSPC, "libfabric: too many connections (%d)", FB_MAX_CONNS);
        goto out;
    }
    if (!d) {
        rc = -ENOMEM;
        goto out;
    }
    memset(c, 0, sizeof *c);
    c->peer = peer;
    c->domain = (uint32_t)(d - t->domains);
    c->slots = calloc(t->tx_depth, sizeof *c->slots);
    if (!c->slots) {
        rc = fb_fail(-ENOMEM, "libfabric: out of memory");
    } else if (!(rc = fb_open_endpoint(t, d->dom, c))) {
        fb_info info = {.magic = FB_INFO_MAGIC, .version = FB_INFO_VERSION,
                        .node_id = t->base.node_id,
                        .flags = (t->virt ? FB_INFO_VIRT : 0) | (t->table ? FB_INFO_TABLE : 0)};
        snprintf(info.provider, sizeof info.provider, "%s", t->provider);
        size_t len = sizeof info.addr;
        int e = fi_getname(&c->ep->fid, info.addr, &len);
        if (e) {
            fb_close_endpoint(c);
            rc = fb_fail(fb_errno(e), "libfabric: fi_getname on %s: %s%s", t->provider,
                         fbl_strerror(-e), e == -FI_ETOOSMALL ? " (address too long)" : "");
        } else {
            info.addr_len = (uint32_t)len;
            /* provider keys: the writer aims through our regions' addresses */
            uint64_t *table = (uint64_t *)((char *)info_out + sizeof info);
            for (uint32_t k = 0; t->table && k < t->num_regions; k++)
                table[k] = t->regions[k].key ? (uint64_t)(uintptr_t)t->regions[k].addr : 0;
            info.num_regions = t->table ? t->num_regions : 0;
            memcpy(info_out, &info, sizeof info);
            *info_len = (uint32_t)(sizeof info + info.num_regions * sizeof(uint64_t));
        }
    }
    if (rc) {
        free(c->slots);
        memset(c, 0, sizeof *c);
        fb_domain_tidy(t, d);
        goto out;
    }
    c->used = 1;
    d->num_conns++;
    if (i >= t->conns_hi)
        t->conns_hi = i + 1;
    *conn_out = i;
out:
    pthread_mutex_unlock(&t->mu);
    return rc;
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
    if (info.num_regions > FB_MAX_REGIONS || len != sizeof info + info.num_regions * 8ull)
        return fb_fail(-EINVAL, "libfabric: connection info of %u bytes for %u regions", len,
                       info.num_regions);
    if (info.magic != FB_INFO_MAGIC || info.version != FB_INFO_VERSION)
        return fb_fail(-EPROTO, "libfabric: connection info has magic 0x%x version %u, expected "
                                "0x%x version %u", info.magic, info.version, FB_INFO_MAGIC,
                       FB_INFO_VERSION);
    info.provider[sizeof info.provider - 1] = 0;
    pthread_mutex_lock(&t->mu);
    fb_conn *c = conn < FB_MAX_CONNS && t->conns[conn].used ? &t->conns[conn] : NULL;
    int rc = 0;
    if (!c)
        rc = fb_fail(-ENOENT, "libfabric: unknown connection %u", conn);
    else if (c->ready)
        rc = fb_fail(-EISCONN, "libfabric: connection %u is complete already", conn);
    else if (info.node_id != c->peer)
        rc = fb_fail(-EPROTO, "libfabric: connection %u was prepared for peer %llu, the info is "
                              "from node %llu", conn, (unsigned long long)c->peer,
                     (unsigned long long)info.node_id);
    else if (strcmp(info.provider, t->provider))
        rc = fb_fail(-EPROTO, "libfabric: peer %llu runs provider '%s', this node '%s'",
                     (unsigned long long)c->peer, info.provider, t->provider);
    else if (!info.addr_len || info.addr_len > sizeof info.addr)
        rc = fb_fail(-EPROTO, "libfabric: peer address of %u bytes", info.addr_len);
    if (!rc) {
        int n = fi_av_insert(c->av, info.addr, 1, &c->dest, 0, NULL);
        if (n != 1)
            rc = fb_fail(n < 0 ? fb_errno(n) : -EINVAL, "libfabric: fi_av_insert of peer %llu's "
                                                        "address on %s: %s",
                         (unsigned long long)c->peer, t->provider,
                         n < 0 ? fbl_strerror(-n) : "not inserted");
    }
    if (!rc && (info.flags & FB_INFO_TABLE)) {
        c->peer_table = malloc(info.num_regions * sizeof(uint64_t) + 1);
        if (!c->peer_table)
            rc = fb_fail(-ENOMEM, "libfabric: out of memory");
        else
            memcpy(c->peer_table, (const char *)blob + sizeof info, info.num_regions * 8ull);
        c->peer_table_n = info.num_regions;
    }
    if (!rc) {
        c->peer_virt = !!(info.flags & FB_INFO_VIRT);
        c->ready = 1;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* Called with t->mu held. */
void fb_drop_conn(fb_transport *t, fb_conn *c, const char *why)
{
    fb_flush_backlog(t, c, -ECONNRESET, why);
    fb_close_endpoint(c);
    fb_fail_outstanding(t, c, -ECONNRESET, why);
    free(c->slots);
    free(c->backlog);
    free(c->peer_table);
    fb_domain *d = &t->domains[c->domain];
    memset(c, 0, sizeof *c);
    if (d->num_conns)
        d->num_conns--;
    fb_domain_tidy(t, d);
}

int fb_disconnect(pdkv_transport *base, uint32_t conn)
{
    fb_transport *t = (fb_transport *)base;
    pthread_mutex_lock(&t->mu);
    int rc = 0;
    if (conn >= FB_MAX_CONNS || !t->conns[conn].used)
        rc = fb_fail(-ENOENT, "libfabric: unknown connection %u", conn);
    else
        fb_drop_conn(t, &t->conns[conn], "disconnected");
    pthread_mutex_unlock(&t->mu);
    return rc;
}
#endif /* PDKV_HAVE_LIBFABRIC */
