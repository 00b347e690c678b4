/* pdkv verbs over several NICs: connections (one single-NIC connection per (local NIC, remote
 * NIC) pair) and the routing of writes onto them (verbs_multi.h).
 *
 * Info blob: a header (magic, version, node id, num_nics, num_remote, child_len) and then, for
 * each local NIC i and each remote NIC j < num_remote, the single-NIC info of the pair (i, j).
 * Both sides prepare before they see the other's blob, so each prepares pairs toward
 * num_remote NICs (default: VM_MAX_NICS, any host; messenger remote_nics to prepare fewer) and
 * complete() connects pair (i, j) with the peer's (j, i), drops the pairs toward NICs the peer
 * does not have, and refuses (naming both counts) when the peer has NICs it prepared no pair for.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS). */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_multi.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct vm_info_head {
    uint32_t magic, version;
    uint64_t node_id;
    uint32_t num_nics, num_remote, child_len, pad;
} vm_info_head;

/* Caller holds t->mu: every prepared pair of c is dropped. */
static void drop(vm_transport *t, vm_conn *c)
{
    for (uint32_t i = 0; i < t->num_nics; i++)
        for (uint32_t j = 0; j < VM_MAX_NICS; j++)
            if (c->have[i][j])
                t->nic[i]->ops->disconnect(t->nic[i], c->cid[i][j]);
    memset(c, 0, sizeof *c);
}

int vm_prepare(pdkv_transport *base, uint64_t peer, void *info_out, uint32_t *info_len,
               uint32_t *conn_out)
{
    vm_transport *t = (vm_transport *)base;
    uint32_t k = t->num_remote_default, child_len = sizeof(vb_info);
    uint64_t total = sizeof(vm_info_head) + (uint64_t)t->num_nics * k * child_len;
    if (total > PDKV_INFO_MAX) {
        vb_fail(NULL, "verbs: %u NICs x %u remote NICs need a %llu-byte connection info (limit %d)",
                t->num_nics, k, (unsigned long long)total, PDKV_INFO_MAX);
        return -E2BIG;
    }
    pthread_mutex_lock(&t->mu);
    uint32_t ci = 0;
    while (ci < VM_MAX_CONNS && t->conns[ci].used)
        ci++;
    if (ci == VM_MAX_CONNS) {
        pthread_mutex_unlock(&t->mu);
        vb_fail(NULL, "verbs: too many connections (%d)", VM_MAX_CONNS);
        return -EMFILE;
    }
    vm_conn *c = &t->conns[ci];
    memset(c, 0, sizeof *c);
    c->used = 1;
    c->peer = peer;
    c->num_remote = k;
    uint8_t *out = info_out;
    vm_info_head h = {.magic = VM_INFO_MAGIC, .version = VM_INFO_VERSION, .node_id = base->node_id,
                      .num_nics = t->num_nics, .num_remote = k, .child_len = child_len};
    memcpy(out, &h, sizeof h);
    int rc = 0;
    for (uint32_t i = 0; !rc && i < t->num_nics; i++)
        for (uint32_t j = 0; !rc && j < k; j++) {
            uint32_t len = 0;
            uint8_t *blob = out + sizeof h + ((uint64_t)i * k + j) * child_len;
            rc = t->nic[i]->ops->prepare(t->nic[i], peer, blob, &len, &c->cid[i][j]);
            if (!rc && len != child_len) {
                vb_fail(NULL, "verbs: NIC %s gave a %u-byte connection info, expected %u", t->names[i],
                        len, child_len);
                t->nic[i]->ops->disconnect(t->nic[i], c->cid[i][j]);
                rc = -EPROTO;
            } else if (!rc) {
                c->have[i][j] = 1;
            }
        }
    if (rc) {
        drop(t, c);
    } else {
        *info_len = (uint32_t)total;
        *conn_out = ci;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int vm_complete(pdkv_transport *base, uint32_t conn, const void *info, uint32_t len)
{
    vm_transport *t = (vm_transport *)base;
    vm_info_head h;
    memset(&h, 0, sizeof h);
    if (len >= sizeof h)
        memcpy(&h, info, sizeof h);
    pthread_mutex_lock(&t->mu);
    vm_conn *c = conn < VM_MAX_CONNS ? &t->conns[conn] : NULL;
    int rc = 0;
    if (!c || !c->used || c->ready) {
        vb_fail(NULL, "verbs: complete on connection %u that is not being prepared", conn);
        rc = -ENOENT;
    } else if (len < sizeof h || h.magic != VM_INFO_MAGIC || h.version != VM_INFO_VERSION ||
               h.child_len != sizeof(vb_info) || !h.num_nics || h.num_nics > VM_MAX_NICS ||
               h.num_remote > VM_MAX_NICS ||
               len != sizeof h + (uint64_t)h.num_nics * h.num_remote * h.child_len) {
        vb_fail(NULL, "verbs: peer connection info is not a pdkv multi-NIC verbs v%d blob (%u bytes)",
                VM_INFO_VERSION, len);
        rc = -EPROTO;
    } else if (h.node_id != c->peer) {
        vb_fail(NULL, "verbs: connection info comes from node %llu, expected %llu",
                (unsigned long long)h.node_id, (unsigned long long)c->peer);
        rc = -EPROTO;
    } else if (h.num_nics > c->num_remote || t->num_nics > h.num_remote) {
        vb_fail(NULL, "verbs: peer %llu has %u NICs and prepared queue pairs toward %u of ours; we have "
                      "%u NICs and prepared pairs toward %u of its: set messenger remote_nics to the "
                      "larger NIC count on both", (unsigned long long)c->peer, h.num_nics, h.num_remote,
                t->num_nics, c->num_remote);
        rc = -EPROTO;
    }
    const uint8_t *blobs = (const uint8_t *)info + sizeof h;
    for (uint32_t i = 0; !rc && i < t->num_nics; i++)
        for (uint32_t j = 0; !rc && j < c->num_remote; j++) {
            if (j >= h.num_nics) { /* toward a NIC the peer does not have */
                t->nic[i]->ops->disconnect(t->nic[i], c->cid[i][j]);
                c->have[i][j] = 0;
                continue;
            }
            const uint8_t *theirs = blobs + ((uint64_t)j * h.num_remote + i) * h.child_len;
            rc = t->nic[i]->ops->complete(t->nic[i], c->cid[i][j], theirs, h.child_len);
            if (rc) {
                char why[200];
                snprintf(why, sizeof why, "%s", vb_errbuf());
                vb_fail(NULL, "%s (local NIC %s -> remote NIC %u)", why, t->names[i], j);
            } else {
                c->have[i][j] = 2;
            }
        }
    if (!rc) {
        c->ready = 1;
        c->num_remote = h.num_nics;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int vm_disconnect(pdkv_transport *base, uint32_t conn)
{
    vm_transport *t = (vm_transport *)base;
    pthread_mutex_lock(&t->mu);
    int ok = conn < VM_MAX_CONNS && t->conns[conn].used;
    if (ok)
        drop(t, &t->conns[conn]);
    pthread_mutex_unlock(&t->mu);
    if (!ok) {
        vb_fail(NULL, "verbs: disconnect of unknown connection %u", conn);
        return -ENOENT;
    }
    return 0;
}

/* Writes grouped by (local NIC, remote NIC) pair; each group posted on its pair's connection.
 * Every write is checked before any is posted; if a NIC refuses a later group, its writes get
 * ERROR completions (the earlier groups are on their queues: the call must not fail half-done). */
int vm_post(pdkv_transport *base, uint32_t conn, const pdkv_write *w, int n)
{
    vm_transport *t = (vm_transport *)base;
    if (n < 0 || (n && !w)) {
        vb_fail(NULL, "verbs: bad write count %d", n);
        return -EINVAL;
    }
    pdkv_write *tr = n ? malloc((size_t)n * sizeof *tr) : NULL;
    uint16_t *pair = n ? malloc((size_t)n * sizeof *pair) : NULL;
    if (n && (!tr || !pair)) {
        free(tr);
        free(pair);
        vb_fail(NULL, "verbs: out of memory for %d writes", n);
        return -ENOMEM;
    }
    int rc = 0;
    pthread_mutex_lock(&t->mu);
    vm_conn *c = conn < VM_MAX_CONNS ? &t->conns[conn] : NULL;
    if (!c || !c->used || !c->ready) {
        vb_fail(NULL, "verbs: connection %u is not connected", conn);
        rc = -ENOTCONN;
    }
    uint32_t per_pair[VM_MAX_NICS * VM_MAX_NICS];
    memset(per_pair, 0, sizeof per_pair);
    for (int k = 0; !rc && k < n; k++) {
        vm_region *r = vm_find_region(t, w[k].lkey);
        uint32_t i = VM_KEY_NIC(w[k].lkey), j = VM_KEY_NIC(w[k].rkey);
        if (!r) {
            int dying = VM_KEY_INDEX(w[k].lkey) && VM_KEY_INDEX(w[k].lkey) <= VM_MAX_REGIONS &&
                        t->regions[VM_KEY_INDEX(w[k].lkey) - 1].dying;
            vb_fail(NULL, "verbs: write %d names %s local key 0x%llx%s", k, dying ? "the" : "unknown",
                    (unsigned long long)w[k].lkey, dying ? " of a region being deregistered" : "");
            rc = -ENOENT;
        } else if (j >= c->num_remote || c->have[i][j] != 2) {
            vb_fail(NULL, "verbs: write %d: no queue pair from NIC %s to remote NIC %u of peer %llu "
                          "(remote key 0x%llx)", k, t->names[i], j, (unsigned long long)c->peer,
                    (unsigned long long)w[k].rkey);
            rc = -EINVAL;
        } else {
            tr[k] = w[k];
            tr[k].lkey = r->child_key[i];
            tr[k].rkey = VM_KEY_LOW(w[k].rkey); /* the sender uses only page offset and rkey */
            pair[k] = (uint16_t)(i * VM_MAX_NICS + j);
            per_pair[pair[k]]++;
        }
    }
    /* counting sort by pair (stable: each pair keeps the caller's order) */
    pdkv_write *sorted = !rc && n ? malloc((size_t)n * sizeof *sorted) : NULL;
    if (!rc && n && !sorted) {
        vb_fail(NULL, "verbs: out of memory for %d writes", n);
        rc = -ENOMEM;
    }
    uint32_t start[VM_MAX_NICS * VM_MAX_NICS + 1];
    int posted_any = 0;
    if (!rc && n) {
        start[0] = 0;
        for (uint32_t p = 0; p < VM_MAX_NICS * VM_MAX_NICS; p++)
            start[p + 1] = start[p] + per_pair[p];
        uint32_t fill[VM_MAX_NICS * VM_MAX_NICS];
        memcpy(fill, start, sizeof fill);
        for (int k = 0; k < n; k++)
            sorted[fill[pair[k]]++] = tr[k];
        for (uint32_t p = 0; p < VM_MAX_NICS * VM_MAX_NICS; p++) {
            if (!per_pair[p])
                continue;
            uint32_t i = p / VM_MAX_NICS, j = p % VM_MAX_NICS, cnt = per_pair[p];
            pdkv_write *g = &sorted[start[p]];
            int got = t->nic[i]->ops->post(t->nic[i], c->cid[i][j], g, (int)cnt);
            if (got < 0 && !posted_any) {
                char why[200];
                snprintf(why, sizeof why, "%s", vb_errbuf());
                vb_fail(NULL, "%s (NIC %s)", why, t->names[i]);
                rc = got;
                break;
            }
            posted_any = 1;
            if (got < 0) {
                for (uint32_t k = 0; k < cnt; k++) {
                    pdkv_completion e = {.kind = PDKV_CQ_ERROR, .wr_id = g[k].wr_id, .peer = c->peer,
                                         .status = got};
                    snprintf(e.reason, sizeof e.reason, "verbs: NIC %s refused the write: %s", t->names[i],
                             vb_errbuf());
                    vm_errq_push(t, &e);
                }
                t->count[i].errors += cnt;
                continue;
            }
            t->count[i].writes += cnt;
            for (uint32_t k = 0; k < cnt; k++)
                t->count[i].bytes += g[k].len;
        }
    }
    pthread_mutex_unlock(&t->mu);
    free(sorted);
    free(tr);
    free(pair);
    return rc ? rc : n;
}
#endif /* PDKV_HAVE_VERBS */
