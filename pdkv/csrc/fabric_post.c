/* pdkv libfabric transport: posting writes onto one endpoint pair (fabric_link.c routes them).
 * post() never blocks: a batch is checked whole, enters the endpoint's backlog, and is handed to the provider in one burst under one lock as far as
 * the endpoint takes it; -FI_EAGAIN (the provider's queue is full, or it needs progress first)
 * leaves the rest in the backlog for the progress thread, which pumps again after each pass over
 * the completion queues. A write with an immediate is fi_writemsg with FI_REMOTE_CQ_DATA: the
 * 32-bit value arrives as remote CQ data on the target's completion queue. Writes complete at
 * delivery (FI_DELIVERY_COMPLETE, what a verbs RC ack means), so a write the target's provider
 * refused fails at the writer (tcp;ofi_rxm reports it only so); shm never completes a refused
 * write under it, so there writes complete at transmit (fabric_setup.c).
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Called with t->mu held: every write is checked before any is accepted. */
int fb_check_writes(fb_transport *t, const pdkv_write *w, int n)
{
    for (int i = 0; i < n; i++) {
        fb_region *r = fb_find_region(t, w[i].lkey);
        if (!r)
            return fb_fail(-ENOENT, "libfabric: write %d names unknown local key 0x%llx", i,
                           (unsigned long long)w[i].lkey);
        if (w[i].len > r->len || w[i].loff > r->len - w[i].len)
            return fb_fail(-ERANGE, "libfabric: write %d: [%llu, +%llu) is outside the local "
                                    "region of %llu bytes", i, (unsigned long long)w[i].loff,
                           (unsigned long long)w[i].len, (unsigned long long)r->len);
    }
    return 0;
}

void fb_flush_backlog(fb_transport *t, fb_conn *c, int status, const char *why)
{
    for (; c->bl_count; c->bl_count--, c->bl_head = (c->bl_head + 1) % c->bl_cap) {
        const pdkv_write *w = &c->backlog[c->bl_head];
        fb_region *r = fb_find_region(t, w->lkey);
        if (r && r->inflight)
            r->inflight--;
        fb_push_error(t, w->wr_id, c->peer, status, "libfabric: write to peer %llu not posted: %s",
                      (unsigned long long)c->peer, why);
    }
}

/* The endpoint is closed (nothing more completes): every write still outstanding failed. */
void fb_fail_outstanding(fb_transport *t, fb_conn *c, int status, const char *why)
{
    for (uint32_t i = 0; c->slots && i < t->tx_depth && c->outstanding; i++) {
        fb_pending *p = &c->slots[i];
        if (!p->used)
            continue;
        if (t->regions[p->region].inflight)
            t->regions[p->region].inflight--;
        fb_push_error(t, p->wr_id, c->peer, status, "libfabric: write to peer %llu failed: %s",
                      (unsigned long long)c->peer, why);
        p->used = 0;
        c->outstanding--;
    }
}

static fb_pending *take_slot(fb_transport *t, fb_conn *c)
{
    for (uint32_t n = 0; n < t->tx_depth; n++) {
        uint32_t i = (c->next_slot + n) % t->tx_depth;
        if (!c->slots[i].used) {
            c->next_slot = (i + 1) % t->tx_depth;
            return &c->slots[i];
        }
    }
    return NULL;
}

/* Where a write goes on the peer: the key's base (our requested keys), or the peer's region
 * table (provider keys). -1 when a provider key names no region of the table. */
static int aim(const fb_conn *c, const pdkv_write *w, struct fi_rma_iov *rma)
{
    if (!c->peer_table) {
        uint64_t base = FB_WKEY_BASE(w->rkey);
        rma->addr = c->peer_virt ? base + w->roff : w->roff - base;
        return 0;
    }
    uint32_t idx = (uint32_t)(w->rkey & 0x3ff);
    if (!(w->rkey & FB_TABLE_FLAG) || !idx || idx > c->peer_table_n || !c->peer_table[idx - 1])
        return -1;
    rma->addr = c->peer_table[idx - 1] + w->roff;
    rma->key = w->rkey >> 32;
    return 0;
}

/* Called with t->mu held. Returns how many writes the provider took. The writes of one pass
 * go as one burst: each but the pass's last carries FI_MORE (the provider may hold them, e.g.
 * ring the device's doorbell once, until a write without it). A pass that ends early on
 * FI_EAGAIN after an FI_MORE write leaves the held writes to the provider's progress, which the
 * progress thread drives before it pumps the rest (whose last write goes without FI_MORE). */
int fb_pump(fb_transport *t, fb_conn *c)
{
    int n = 0;
    fb_domain *d = &t->domains[c->domain];
    uint32_t room = t->tx_depth - c->outstanding; /* free slots: tx_depth counts every used one */
    uint32_t burst = c->bl_count < room ? c->bl_count : room;
    while (c->ready && !c->broken && c->bl_count && c->outstanding < t->tx_depth) {
        const pdkv_write *w = &c->backlog[c->bl_head];
        fb_region *r = fb_find_region(t, w->lkey);
        uint32_t idx = (uint32_t)(r - t->regions);
        fb_pending *p = take_slot(t, c);
        if (!p)
            break;
        struct fi_rma_iov rma = {.len = w->len, .key = w->rkey};
        if (aim(c, w, &rma)) {
            c->bl_head = (c->bl_head + 1) % c->bl_cap;
            c->bl_count--;
            if (burst)
                burst--;
            if (r->inflight)
                r->inflight--;
            fb_push_error(t, w->wr_id, c->peer, -EINVAL, "libfabric: key 0x%llx names no region "
                          "of peer %llu's table (registered after this connection was made? "
                          "reconnect)", (unsigned long long)w->rkey, (unsigned long long)c->peer);
            continue;
        }
        struct iovec iov = {.iov_base = r->addr + w->loff, .iov_len = w->len};
        struct fid_mr *lmr = t->mr_ep ? c->lmr[idx] : d->lmr[idx];
        void *desc = lmr ? fi_mr_desc(lmr) : NULL;
        memset(&p->ctx, 0, sizeof p->ctx);
        struct fi_msg_rma msg = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = c->dest,
                                 .rma_iov = &rma, .rma_iov_count = 1, .context = p,
                                 .data = w->imm};
        uint64_t flags = FI_COMPLETION | (w->has_imm ? FI_REMOTE_CQ_DATA : 0) | t->complete_flag;
        if (burst > 1 && t->batch_more)
            flags |= FI_MORE;
        ssize_t rc = fi_writemsg(c->ep, &msg, flags);
        if (rc == -FI_EAGAIN)
            break; /* the progress thread pumps again after reading the CQ */
        c->bl_head = (c->bl_head + 1) % c->bl_cap;
        c->bl_count--;
        if (burst)
            burst--;
        if (rc) {
            if (r->inflight)
                r->inflight--;
            fb_push_error(t, w->wr_id, c->peer, fb_errno((int)rc),
                          "libfabric: fi_writemsg to peer %llu: %s", (unsigned long long)c->peer,
                          fbl_strerror((int)-rc));
            continue;
        }
        p->used = 1;
        p->wr_id = w->wr_id, p->len = w->len, p->region = idx;
        t->dev[c->dev].nic.writes++, t->dev[c->dev].nic.bytes += w->len;
        c->outstanding++;
        c->last_ns = fb_now_ns();
        n++;
    }
    return n;
}

int fb_reserve(fb_conn *c, uint32_t need)
{
    if (c->bl_count + need <= c->bl_cap)
        return 0;
    uint32_t cap = c->bl_cap ? c->bl_cap : 256;
    while (cap < c->bl_count + need)
        cap *= 2;
    pdkv_write *b = malloc((size_t)cap * sizeof *b);
    if (!b)
        return -ENOMEM;
    for (uint32_t i = 0; i < c->bl_count; i++)
        b[i] = c->backlog[(c->bl_head + i) % c->bl_cap];
    free(c->backlog);
    c->backlog = b, c->bl_cap = cap, c->bl_head = 0;
    return 0;
}

/* Called with t->mu held, the writes checked (fb_check_writes) and room reserved (fb_reserve). */
void fb_enqueue(fb_transport *t, fb_conn *c, const pdkv_write *w, int n)
{
    if (!c->bl_count && !c->outstanding)
        c->last_ns = fb_now_ns(); /* the stall clock starts with work */
    for (int i = 0; i < n; i++) {
        c->backlog[(c->bl_head + c->bl_count++) % c->bl_cap] = w[i];
        fb_find_region(t, w[i].lkey)->inflight++;
    }
    fb_pump(t, c);
}
#endif /* PDKV_HAVE_LIBFABRIC */
