/* pdkv verbs transport: posting writes. post() never blocks: writes enter the connection's
 * backlog and are moved onto its QPs' send queues as far as they have room; the progress thread
 * moves more after each send completion. (A send queue fills when the peer stops answering; on
 * real hardware the peer's NIC answers even if its process is stopped, and receiver-not-ready
 * is retried for about a second — posting must not wait on either.)
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define VB_CHUNK 32 /* WRs handed to one ibv_post_send call */

/* Called with t->mu held: every write is checked before any is accepted. */
static int check_writes(vb_transport *t, const pdkv_write *w, int n)
{
    for (int i = 0; i < n; i++) {
        vb_region *r = vb_find_region(t, w[i].lkey);
        if (!r) {
            vb_fail(t, "verbs: write %d names unknown local key 0x%llx", i,
                    (unsigned long long)w[i].lkey);
            return -ENOENT;
        }
        if (r->dying) {
            vb_fail(t, "verbs: write %d: local region 0x%llx is being deregistered (an MR was busy; "
                       "deregister it again)", i, (unsigned long long)r->key);
            return -ENOENT;
        }
        if (w[i].len > r->len || w[i].loff > r->len - w[i].len || w[i].len > (1ull << 31)) {
            vb_fail(t, "verbs: write %d: [%llu, +%llu) is outside the local region of %llu bytes",
                    i, (unsigned long long)w[i].loff, (unsigned long long)w[i].len,
                    (unsigned long long)r->len);
            return -ERANGE;
        }
    }
    return 0;
}

/* Called with t->mu held: each write not yet on a send queue completes with an error. */
void vb_flush_backlog(vb_transport *t, vb_conn *c, int status, const char *why)
{
    for (; c->bl_count; c->bl_count--, c->bl_head = (c->bl_head + 1) % c->bl_cap) {
        const pdkv_write *w = &c->backlog[c->bl_head];
        vb_region *r = vb_find_region(t, w->lkey);
        if (r && r->inflight)
            r->inflight--;
        vb_push_error(t, w->wr_id, c->peer, status, "verbs: write to peer %llu not posted: %s",
                      (unsigned long long)c->peer, why);
    }
}

void vb_fail_outstanding(vb_transport *t, vb_conn *c, vb_qp *q, int status, const char *why)
{
    if (!q->qp)
        return;
    /* once ibv_modify_qp(ERR) returns, the QP reads no more source memory: a WR failed here may
     * have landed (reported failed: safe) but one reported done has surely landed */
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    ibv_modify_qp(q->qp, &a, IBV_QP_STATE);
    for (; q->count; q->count--, q->head_seq++) {
        vb_pending p = q->ring[q->head_seq % t->sq_depth];
        if (t->regions[p.region].inflight)
            t->regions[p.region].inflight--;
        vb_push_error(t, p.wr_id, c->peer, status, "verbs: write to peer %llu failed: %s",
                      (unsigned long long)c->peer, why);
    }
}

/* Called with t->mu held. Posts w[0..n) on one QP; returns how many the QP accepted. */
static int post_chunk(vb_transport *t, vb_conn *c, vb_qp *q, const pdkv_write *w, int n)
{
    struct ibv_send_wr wrs[VB_CHUNK], *bad = NULL;
    struct ibv_sge sges[VB_CHUNK];
    for (int j = 0; j < n; j++) {
        vb_region *r = vb_find_region(t, w[j].lkey);
        uint64_t seq = q->next_seq++;
        q->ring[seq % t->sq_depth] = (vb_pending){w[j].wr_id, w[j].len, (uint32_t)(r - t->regions)};
        sges[j] = (struct ibv_sge){.addr = VB_KEY_PGOFF(w[j].lkey) + w[j].loff,
                                   .length = (uint32_t)w[j].len, .lkey = vb_lkey(t, c, r)};
        memset(&wrs[j], 0, sizeof wrs[j]);
        wrs[j].wr_id = seq;
        wrs[j].next = j + 1 < n ? &wrs[j + 1] : NULL;
        wrs[j].sg_list = &sges[j];
        wrs[j].num_sge = w[j].len ? 1 : 0;
        wrs[j].opcode = w[j].has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
        wrs[j].imm_data = htonl(w[j].imm);
        /* NOTE: the last WR of every call is signaled, so no unsignaled WR is left unretired. */
        if (seq % VB_SIGNAL_EVERY == VB_SIGNAL_EVERY - 1 || j == n - 1)
            wrs[j].send_flags = IBV_SEND_SIGNALED;
        wrs[j].wr.rdma.remote_addr = VB_KEY_PGOFF(w[j].rkey) + w[j].roff;
        wrs[j].wr.rdma.rkey = (uint32_t)w[j].rkey;
    }
    q->count += (uint32_t)n;
    int rc = ibv_post_send(q->qp, wrs, &bad);
    if (!rc)
        return n;
    int accepted = bad ? (int)(bad - wrs) : 0;
    q->next_seq -= (uint64_t)(n - accepted); /* un-queue what the QP refused */
    q->count -= (uint32_t)(n - accepted);
    /* The accepted tail may be unsignaled: break the QP and fail what it holds now. */
    c->broken = 1;
    vb_fail(t, "verbs: ibv_post_send to peer %llu failed: %s", (unsigned long long)c->peer,
            strerror(rc));
    char why[256];
    snprintf(why, sizeof why, "%s", vb_errbuf());
    vb_fail_outstanding(t, c, q, -EIO, why);
    vb_fail(t, "%s", why);
    return accepted;
}

/* Called with t->mu held: moves backlog writes onto send queues that have room. */
void vb_pump(vb_transport *t, vb_conn *c)
{
    pdkv_write w[VB_CHUNK];
    uint32_t full = 0; /* QPs in a row found without room */
    while (c->bl_count && !c->broken && full < t->qps_per_peer) {
        vb_qp *q = &c->qps[c->rr++ % t->qps_per_peer];
        uint32_t room = t->sq_depth - q->count, k = c->bl_count;
        k = k < VB_CHUNK ? k : VB_CHUNK;
        k = k < room ? k : room;
        if (!k) {
            full++;
            continue;
        }
        full = 0;
        for (uint32_t j = 0; j < k; j++)
            w[j] = c->backlog[(c->bl_head + j) % c->bl_cap];
        c->bl_head = (c->bl_head + k) % c->bl_cap;
        c->bl_count -= k;
        int got = post_chunk(t, c, q, w, (int)k);
        for (uint32_t j = (uint32_t)got; j < k; j++) { /* refused: reported here, once */
            vb_region *r = vb_find_region(t, w[j].lkey);
            if (r && r->inflight)
                r->inflight--;
            vb_push_error(t, w[j].wr_id, c->peer, -EIO, "%s", vb_errbuf());
        }
    }
    if (c->broken)
        vb_flush_backlog(t, c, -ECONNRESET, "the connection broke");
}

static int reserve(vb_conn *c, uint32_t n)
{
    if (c->bl_count + n <= c->bl_cap)
        return 0;
    uint32_t cap = c->bl_cap ? c->bl_cap : 256;
    while (cap < c->bl_count + n)
        cap *= 2;
    pdkv_write *b = malloc(cap * sizeof *b);
    if (!b)
        return -ENOMEM;
    for (uint32_t i = 0; i < c->bl_count; i++)
        b[i] = c->backlog[(c->bl_head + i) % c->bl_cap];
    free(c->backlog);
    c->backlog = b;
    c->bl_head = 0;
    c->bl_cap = cap;
    return 0;
}

/* Every accepted write gets exactly one completion (WRITE_DONE or ERROR); a refused call
 * (negative return) gets none. */
int vb_post(pdkv_transport *base, uint32_t conn, const pdkv_write *w, int n)
{
    vb_transport *t = (vb_transport *)base;
    int rc = 0;
    pthread_mutex_lock(&t->mu);
    vb_conn *c = conn < VB_MAX_CONNS ? &t->conns[conn] : NULL;
    if (n < 0 || (n && !w)) {
        vb_fail(t, "verbs: bad write count %d", n);
        rc = -EINVAL;
    } else if (!c || !c->used || !c->ready) {
        vb_fail(t, "verbs: connection %u is not connected", conn);
        rc = -ENOTCONN;
    } else if (c->broken) {
        vb_fail(t, "verbs: connection to peer %llu is broken", (unsigned long long)c->peer);
        rc = -ECONNRESET;
    } else if (!(rc = check_writes(t, w, n)) && (rc = reserve(c, (uint32_t)n))) {
        vb_fail(t, "verbs: out of memory for %d writes", n);
    }
    if (!rc) {
        for (int i = 0; i < n; i++) {
            vb_find_region(t, w[i].lkey)->inflight++; /* NOTE: counts until its completion */
            c->backlog[(c->bl_head + c->bl_count++) % c->bl_cap] = w[i];
        }
        vb_pump(t, c);
    }
    pthread_mutex_unlock(&t->mu);
    return rc ? rc : n;
}
#endif /* PDKV_HAVE_VERBS */
