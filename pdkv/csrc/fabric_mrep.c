/* pdkv libfabric transport: FI_MR_ENDPOINT, a provider that associates MRs with endpoints
 * rather than domains (they are made disabled, and are usable only once bound to an endpoint
 * with fi_mr_bind and enabled with fi_mr_enable; an MR bound to one endpoint is nothing to
 * another).
 *
 * Under it every MR pdkv makes is one MR per endpoint it is used with, bound and enabled before
 * its key is handed out or used:
 *  - a region's local MR (the source of our writes): one on every endpoint, in fb_conn.lmr;
 *  - a grant (whole region or per request): one on every endpoint of the peer's domain on the
 *    grant's device, all under the grant's one key (the peer aims at any of them: its write
 *    arrives through whichever endpoint pair its keys' devices pick). Keys are endpoint-scoped
 *    under this mode, so the same requested key on several endpoints of a domain is no clash.
 * Endpoints are made lazily, only for the pairs a connection uses, and a grant outlives a
 * reconnect: so an endpoint made after a grant gets that grant's MR when it is made
 * (fb_ep_open_mrs, before its name is sent: no write can reach it earlier), and a grant made
 * while the domain has no endpoint yet holds no MR until one is made. A revoke closes every
 * endpoint's MR of the grant; a dropped endpoint's MRs are closed after it (nothing lands then).
 * Provider-chosen keys (FI_MR_PROV_KEY) would give a grant one key per endpoint: refused at
 * create (fabric_setup.c).
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <stdlib.h>

/* [off, off+len) of region r under `key`, bound to endpoint ci and enabled. */
static int ep_mr(fb_transport *t, uint32_t ci, const fb_region *r, uint64_t off, uint64_t len,
                 uint64_t access, uint64_t key, struct fid_mr **out)
{
    fb_conn *c = &t->conns[ci];
    int rc = fb_mr_reg(t, t->domains[c->domain].dom, r, off, len, access, key, out);
    return rc ? rc : fb_mr_bind_ep(t, out, c->ep);
}

static int grant_on(fb_transport *t, fb_grant_mr *g, uint32_t ci)
{
    if (g->num_on_ep == g->on_ep_cap &&
        fb_grow((void **)&g->on_ep, &g->on_ep_cap, sizeof *g->on_ep, 2))
        return -ENOMEM;
    struct fid_mr *mr = NULL;
    int rc = ep_mr(t, ci, &t->regions[g->region], g->off, g->len, FI_REMOTE_WRITE, g->wkey, &mr);
    if (!rc)
        g->on_ep[g->num_on_ep++] = (fb_ep_mr){ci, mr};
    return rc;
}

void fb_ep_grant_close(fb_grant_mr *g)
{
    for (uint32_t i = 0; i < g->num_on_ep; i++)
        fi_close(&g->on_ep[i].mr->fid);
    free(g->on_ep);
    g->on_ep = NULL, g->num_on_ep = g->on_ep_cap = 0;
}

/* The endpoints of domain d that are open (a conn being made is not yet `used`). */
static int on_domain(fb_transport *t, uint32_t ci, const fb_domain *d)
{
    const fb_conn *c = &t->conns[ci];
    return c->used && c->ep && &t->domains[c->domain] == d;
}

int fb_ep_grant(fb_transport *t, fb_domain *d, fb_grant_mr *g)
{
    for (uint32_t ci = 0; ci < t->conns_hi; ci++)
        if (on_domain(t, ci, d)) {
            int rc = grant_on(t, g, ci);
            if (rc) {
                fb_ep_grant_close(g);
                return rc;
            }
        }
    return 0;
}

/* Endpoint ci was just opened (enabled, its name not yet sent): the local MR of every region
 * and an MR of every grant of its domain, bound to it. On failure none is left. */
int fb_ep_open_mrs(fb_transport *t, uint32_t ci)
{
    fb_conn *c = &t->conns[ci];
    fb_domain *d = &t->domains[c->domain];
    c->lmr = calloc(FB_MAX_REGIONS, sizeof *c->lmr);
    int rc = c->lmr ? 0 : fb_fail(-ENOMEM, "libfabric: out of memory");
    for (uint32_t i = 0; !rc && i < t->num_regions; i++)
        if (t->regions[i].key)
            rc = ep_mr(t, ci, &t->regions[i], 0, t->regions[i].len, FI_WRITE | FI_READ,
                       FB_LKEY(i), &c->lmr[i]);
    for (uint32_t i = 0; !rc && i < d->num_grants; i++)
        rc = grant_on(t, &d->grants[i], ci);
    if (rc)
        fb_ep_close_mrs(t, ci);
    return rc;
}

void fb_ep_close_mrs(fb_transport *t, uint32_t ci)
{
    fb_conn *c = &t->conns[ci];
    fb_domain *d = &t->domains[c->domain];
    for (uint32_t i = 0; c->lmr && i < t->num_regions; i++)
        if (c->lmr[i])
            fi_close(&c->lmr[i]->fid);
    free(c->lmr);
    c->lmr = NULL;
    for (uint32_t i = 0; d->used && i < d->num_grants; i++) {
        fb_grant_mr *g = &d->grants[i];
        for (uint32_t k = g->num_on_ep; k-- > 0;)
            if (g->on_ep[k].conn == ci) {
                fi_close(&g->on_ep[k].mr->fid);
                g->on_ep[k] = g->on_ep[--g->num_on_ep];
            }
    }
}

int fb_ep_region(fb_transport *t, uint32_t idx)
{
    const fb_region *r = &t->regions[idx];
    for (uint32_t ci = 0; ci < t->conns_hi; ci++) {
        fb_conn *c = &t->conns[ci];
        if (!c->used || !c->ep || !c->lmr)
            continue;
        int rc = ep_mr(t, ci, r, 0, r->len, FI_WRITE | FI_READ, FB_LKEY(idx), &c->lmr[idx]);
        if (rc) {
            fb_ep_region_close(t, idx);
            return rc;
        }
    }
    return 0;
}

void fb_ep_region_close(fb_transport *t, uint32_t idx)
{
    for (uint32_t ci = 0; ci < t->conns_hi; ci++) {
        fb_conn *c = &t->conns[ci];
        if (c->lmr && c->lmr[idx])
            fi_close(&c->lmr[idx]->fid), c->lmr[idx] = NULL;
    }
}
#endif /* PDKV_HAVE_LIBFABRIC */
