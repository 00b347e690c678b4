/* pdkv verbs transport: protection domains, one per peer with isolate_peers (see
 * verbs_internal.h). A peer's QPs live in its domain, so the NIC lets the peer reach only the
 * MRs of that PD: local-only registrations of our regions (for our writes to it) and the grants
 * given to that peer. Nothing else in this node's memory has an rkey valid on its QPs.
 * Shared mode (the default): domains[0] is t->pd / t->srq for every peer, as before.
 * Every function here is called with t->mu held.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint32_t vb_lkey(vb_transport *t, const vb_conn *c, const vb_region *r)
{
    if (!t->isolate)
        return r->mr->lkey;
    return t->domains[c->domain].lmr[r - t->regions]->lkey;
}

int vb_domain_add_region(vb_transport *t, vb_domain *d, uint32_t i)
{
    vb_region *r = &t->regions[i];
    /* local only: a peer can never write through it, it is the source of our writes */
    d->lmr[i] = vb_mr_reg(d->pd, r, 0, r->len, IBV_ACCESS_LOCAL_WRITE);
    if (!d->lmr[i]) {
        vb_fail(t, "verbs: cannot register region %u in the protection domain of peer %llu: %s", i,
                (unsigned long long)d->peer, strerror(errno ? errno : ENOMEM));
        return -(errno ? errno : ENOMEM);
    }
    return 0;
}

void vb_domain_free(vb_transport *t, vb_domain *d)
{
    for (uint32_t g = 0; g < d->num_grants; g++)
        ibv_dereg_mr(d->grants[g].mr);
    for (uint32_t i = 0; d->lmr && i < VB_MAX_REGIONS; i++)
        if (d->lmr[i])
            ibv_dereg_mr(d->lmr[i]);
    if (d->srq)
        ibv_destroy_srq(d->srq);
    if (d->pd)
        ibv_dealloc_pd(d->pd);
    free(d->lmr);
    free(d->grants);
    memset(d, 0, sizeof *d);
}

static vb_domain *create(vb_transport *t, vb_domain *d, uint64_t peer)
{
    memset(d, 0, sizeof *d);
    d->used = 1;
    d->peer = peer;
    struct ibv_srq_init_attr sa = {.attr = {.max_wr = t->srq_depth, .max_sge = 1}};
    errno = 0;
    if (!(d->lmr = calloc(VB_MAX_REGIONS, sizeof *d->lmr)) || !(d->pd = ibv_alloc_pd(t->ctx)) ||
        !(d->srq = ibv_create_srq(d->pd, &sa)) || vb_post_recvs(d->srq, (int)t->srq_depth)) {
        vb_fail(t, "verbs: cannot create a protection domain and SRQ for peer %llu: %s",
                (unsigned long long)peer, strerror(errno ? errno : ENOMEM));
        vb_domain_free(t, d);
        return NULL;
    }
    for (uint32_t i = 0; i < t->num_regions; i++)
        if (t->regions[i].key && !t->regions[i].dying && vb_domain_add_region(t, d, i)) {
            vb_domain_free(t, d);
            return NULL;
        }
    return d;
}

vb_domain *vb_domain_get(vb_transport *t, uint64_t peer, int make)
{
    if (!t->isolate)
        return &t->domains[0];
    vb_domain *free_slot = NULL;
    for (uint32_t i = 0; i < VB_MAX_DOMAINS; i++) {
        if (t->domains[i].used && t->domains[i].peer == peer)
            return &t->domains[i];
        if (!t->domains[i].used && !free_slot)
            free_slot = &t->domains[i];
    }
    if (!make) {
        vb_fail(t, "verbs: peer %llu holds no grant", (unsigned long long)peer);
        return NULL;
    }
    if (!free_slot) {
        vb_fail(t, "verbs: too many peers with a protection domain (%d)", VB_MAX_DOMAINS);
        return NULL;
    }
    return create(t, free_slot, peer);
}

void vb_domain_tidy(vb_transport *t, vb_domain *d)
{
    if (t->isolate && d->used && !d->num_conns && !d->num_grants)
        vb_domain_free(t, d);
}

/* Deregister every MR of region i in the peers' domains (grants, local MRs); one the device
 * still uses (EBUSY) stays in place for the next call. Returns how many stayed. */
uint32_t vb_domain_drop_region(vb_transport *t, uint32_t i)
{
    uint32_t busy = 0;
    for (uint32_t k = 0; t->isolate && k < VB_MAX_DOMAINS; k++) {
        vb_domain *d = &t->domains[k];
        if (!d->used)
            continue;
        uint32_t here = 0;
        for (uint32_t g = 0; g < d->num_grants;) {
            if (d->grants[g].region == i && !vb_dereg_busy(ibv_dereg_mr(d->grants[g].mr))) {
                d->grants[g] = d->grants[--d->num_grants];
            } else {
                here += d->grants[g].region == i;
                g++;
            }
        }
        if (d->lmr[i] && !vb_dereg_busy(ibv_dereg_mr(d->lmr[i])))
            d->lmr[i] = NULL;
        here += d->lmr[i] != NULL;
        if (!here) /* NOTE: a domain holding a busy MR stays: freeing it would drop the MR unchecked */
            vb_domain_tidy(t, d);
        busy += here;
    }
    return busy;
}
#endif /* PDKV_HAVE_VERBS */
