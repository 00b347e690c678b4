/* pdkv verbs over several NICs: the routing of writes onto the connection's (local NIC, remote
 * NIC) pairs (verbs_multi.h; the pairs are made in verbs_multi_conn.c). A write leaves through
 * the NIC of its local key and arrives through the NIC of its remote key, on that pair's QPs;
 * a pair that was not made (prepare_pairs makes only those the caller said its writes use) is
 * refused, naming it: a write the caller did not plan for is a bug to see, not to reroute.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS). */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_multi.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
