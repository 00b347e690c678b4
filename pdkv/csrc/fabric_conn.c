/* pdkv libfabric transport: endpoints. Each endpoint pair of a connection (fabric_link.c) is an
 * RDM endpoint of its own (with its AV and CQ) in the peer's domain on its device: prepare()
 * opens it and sends its name (fi_getname) in the info blob, which travels over the messenger's
 * authenticated control channel; complete() inserts the peer's name into the AV
 * (fi_av_insert) -- from then on writes go to that address. Dropping a
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

/* An endpoint from device `dev` toward the peer's device `rdev`, in the peer's domain on `dev`
 * (opened with the first one). *ci: its index in t->conns. */
int fb_conn_open(fb_transport *t, uint64_t peer, uint32_t dev, uint32_t rdev, uint32_t *ci)
{
    uint32_t i = 0;
    while (i < FB_MAX_CONNS && t->conns[i].used)
        i++;
    if (i == FB_MAX_CONNS)
        return fb_fail(-ENOSPC, "libfabric: too many endpoints (%d)", FB_MAX_CONNS);
    fb_domain *d = fb_domain_get(t, peer, dev, 1);
    if (!d)
        return -ENOMEM;
    fb_conn *c = &t->conns[i];
    memset(c, 0, sizeof *c);
    c->peer = peer, c->dev = dev, c->rdev = rdev;
    c->domain = (uint32_t)(d - t->domains);
    c->slots = calloc(t->tx_depth, sizeof *c->slots);
    int rc = c->slots ? fb_open_endpoint(t, d->dom, c)
                      : fb_fail(-ENOMEM, "libfabric: out of memory");
    if (!rc && t->mr_ep && (rc = fb_ep_open_mrs(t, i)))
        fb_close_endpoint(c); /* its MRs are gone already */
    if (rc) {
        free(c->slots);
        memset(c, 0, sizeof *c);
        fb_domain_tidy(t, d);
        return rc;
    }
    c->used = 1;
    d->num_conns++;
    if (i >= t->conns_hi)
        t->conns_hi = i + 1;
    *ci = i;
    return 0;
}

/* The endpoint's name (fi_getname), for the peer's fi_av_insert. */
int fb_conn_name(fb_transport *t, fb_conn *c, fb_info_pair *out)
{
    size_t len = sizeof out->addr;
    int e = fi_getname(&c->ep->fid, out->addr, &len);
    if (e)
        return fb_fail(fb_errno(e), "libfabric: fi_getname on %s: %s%s", t->provider,
                       fbl_strerror(-e), e == -FI_ETOOSMALL ? " (address too long)" : "");
    out->dev = (uint8_t)c->dev, out->rdev = (uint8_t)c->rdev;
    out->addr_len = (uint16_t)len;
    return 0;
}

/* From now on the endpoint's writes go to the peer's endpoint named `peer_ep`. */
int fb_conn_connect(fb_transport *t, fb_conn *c, const fb_info_pair *peer_ep)
{
    if (!peer_ep->addr_len || peer_ep->addr_len > sizeof peer_ep->addr)
        return fb_fail(-EPROTO, "libfabric: peer address of %u bytes", peer_ep->addr_len);
    int n = fi_av_insert(c->av, peer_ep->addr, 1, &c->dest, 0, NULL);
    if (n != 1)
        return fb_fail(n < 0 ? fb_errno(n) : -EINVAL, "libfabric: fi_av_insert of peer %llu's "
                       "address on %s (%s): %s", (unsigned long long)c->peer, t->provider,
                       t->dev[c->dev].name, n < 0 ? fbl_strerror(-n) : "not inserted");
    c->ready = 1;
    return 0;
}

/* Called with t->mu held. */
void fb_drop_conn(fb_transport *t, fb_conn *c, const char *why)
{
    fb_flush_backlog(t, c, -ECONNRESET, why);
    fb_close_endpoint(c);
    if (t->mr_ep) /* after the endpoint: nothing reaches its MRs any more */
        fb_ep_close_mrs(t, (uint32_t)(c - t->conns));
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

#endif /* PDKV_HAVE_LIBFABRIC */
