/* pdkv verbs over several NICs: connections, one single-NIC connection per (local NIC, remote
 * NIC) pair (verbs_multi.h).
 *
 * Info blob: a header (magic, version, node id, num_nics, num_remote, child_len, and which
 * pairs were prepared) and then, for each local NIC i and each remote NIC j < num_remote, the
 * single-NIC info of the pair (i, j) (zeros for a pair not prepared). Both sides prepare before
 * they see the other's blob, so each prepares pairs toward num_remote NICs (default:
 * VM_MAX_NICS, any host; messenger remote_nics to prepare fewer): every pair, or (prepare_pairs)
 * only the pairs the caller's writes can use. complete() connects pair (i, j) with the peer's
 * (j, i) when both prepared it, drops the pairs the peer did not prepare or toward NICs it does
 * not have, and refuses (naming both counts) when the peer has NICs it prepared no pair for.
 * The routing of writes onto the pairs is in verbs_multi_post.c.
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
    uint8_t pairs[VM_MAX_NICS][VM_MAX_NICS]; /* [local NIC][remote NIC]: 1 if prepared */
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

uint64_t vm_num_qps(vm_transport *t, uint32_t nic)
{
    uint64_t n = 0;
    for (uint32_t c = 0; c < VM_MAX_CONNS; c++)
        for (uint32_t j = 0; t->conns[c].used && j < VM_MAX_NICS; j++)
            n += t->conns[c].have[nic][j] != 0;
    return n * t->qps_per_peer;
}

/* pairs: NULL (every pair toward k remote NICs) or [VM_MAX_NICS][VM_MAX_NICS] flags. */
static int prepare(vm_transport *t, uint64_t peer, const uint8_t *pairs, void *info_out,
                   uint32_t *info_len, uint32_t *conn_out)
{
    uint32_t k = t->num_remote_default, child_len = sizeof(vb_info), num_pairs = 0;
    uint64_t total = sizeof(vm_info_head) + (uint64_t)t->num_nics * k * child_len;
    if (total > PDKV_INFO_MAX) {
        vb_fail(NULL, "verbs: %u NICs x %u remote NICs need a %llu-byte connection info (limit %d)",
                t->num_nics, k, (unsigned long long)total, PDKV_INFO_MAX);
        return -E2BIG;
    }
    for (uint32_t i = 0; pairs && i < VM_MAX_NICS; i++)
        for (uint32_t j = 0; j < VM_MAX_NICS; j++) {
            if (pairs[i * VM_MAX_NICS + j] && (i >= t->num_nics || j >= k)) {
                vb_fail(NULL, "verbs: queue pair (local NIC %u, remote NIC %u) asked for: this transport has %u "
                              "NICs and prepares pairs toward %u remote NICs", i, j, t->num_nics, k);
                return -EINVAL;
            }
            num_pairs += pairs[i * VM_MAX_NICS + j] != 0;
        }
    if (pairs && !num_pairs) {
        vb_fail(NULL, "verbs: a connection needs at least one (local NIC, remote NIC) queue pair");
        return -EINVAL;
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
    vm_info_head h = {.magic = VM_INFO_MAGIC, .version = VM_INFO_VERSION, .node_id = t->base.node_id,
                      .num_nics = t->num_nics, .num_remote = k, .child_len = child_len};
    memset(out + sizeof h, 0, total - sizeof h);
    int rc = 0;
    for (uint32_t i = 0; !rc && i < t->num_nics; i++)
        for (uint32_t j = 0; !rc && j < k; j++) {
            if (pairs && !pairs[i * VM_MAX_NICS + j])
                continue; /* no writes of the caller's use it: no QPs */
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
                h.pairs[i][j] = 1;
            }
        }
    memcpy(out, &h, sizeof h);
    if (rc) {
        drop(t, c);
    } else {
        *info_len = (uint32_t)total;
        *conn_out = ci;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int vm_prepare(pdkv_transport *base, uint64_t peer, void *info_out, uint32_t *info_len,
               uint32_t *conn_out)
{
    return prepare((vm_transport *)base, peer, NULL, info_out, info_len, conn_out);
}

int vm_prepare_pairs(pdkv_transport *base, uint64_t peer, const uint8_t *pairs, void *info_out,
                     uint32_t *info_len, uint32_t *conn_out)
{
    if (!pairs) {
        vb_fail(NULL, "verbs: prepare_pairs needs the pairs");
        return -EINVAL;
    }
    return prepare((vm_transport *)base, peer, pairs, info_out, info_len, conn_out);
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
    uint32_t num_pairs = 0;
    for (uint32_t i = 0; !rc && i < t->num_nics; i++)
        for (uint32_t j = 0; !rc && j < c->num_remote; j++) {
            if (!c->have[i][j])
                continue; /* not prepared here: the peer drops its side of it too */
            if (j >= h.num_nics || !h.pairs[j][i]) { /* a NIC the peer lacks, or a pair it did not make */
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
                num_pairs++;
            }
        }
    if (!rc && !num_pairs) {
        vb_fail(NULL, "verbs: peer %llu and this node asked for no queue pair in common", (unsigned long long)c->peer);
        rc = -EPROTO;
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

#endif /* PDKV_HAVE_VERBS */
