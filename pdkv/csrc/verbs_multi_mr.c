/* pdkv verbs over several NICs: regions, grants and keys (verbs_multi.h).
 *
 * A region is registered on every NIC (one MR per NIC over the same pages); its key on NIC n
 * carries n and that NIC's rkey. Grants are NIC-specific like the keys they return: granting a
 * region's key on NIC j registers the grant in peer's protection domain on NIC j only, so the
 * peer's writes must arrive through NIC j (the NIC the layer above chose for that destination).
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS). */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_multi.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void vm_errq_push(vm_transport *t, const pdkv_completion *c)
{
    if (t->errq_count == t->errq_cap) {
        uint32_t cap = t->errq_cap ? t->errq_cap * 2 : 64;
        pdkv_completion *q = malloc(cap * sizeof *q);
        if (!q)
            return; /* out of memory: the write's batch never completes; nothing better to do */
        for (uint32_t i = 0; i < t->errq_count; i++)
            q[i] = t->errq[(t->errq_head + i) % t->errq_cap];
        free(t->errq);
        t->errq = q;
        t->errq_head = 0;
        t->errq_cap = cap;
    }
    t->errq[(t->errq_head + t->errq_count++) % t->errq_cap] = *c;
    uint64_t one = 1;
    if (write(t->efd, &one, sizeof one) < 0) {
        /* saturated: readable anyway */
    }
}

/* The region of key, dying or not (dereg retries a dying one). */
static vm_region *find_any(vm_transport *t, uint64_t key)
{
    uint32_t idx = VM_KEY_INDEX(key), nic = VM_KEY_NIC(key);
    /* the page offset must be the region's (as on one NIC): a key with other bits is not ours */
    if (!idx || idx > VM_MAX_REGIONS || !t->regions[idx - 1].used || nic >= t->num_nics ||
        VB_KEY_PGOFF(key) != VB_KEY_PGOFF(t->regions[idx - 1].child_key[nic])) {
        vb_fail(NULL, "verbs: unknown key 0x%llx", (unsigned long long)key);
        return NULL;
    }
    return &t->regions[idx - 1];
}

vm_region *vm_find_region(vm_transport *t, uint64_t key)
{
    vm_region *r = find_any(t, key);
    if (r && r->dying) {
        vb_fail(NULL, "verbs: region of key 0x%llx is being deregistered (a NIC was busy; deregister "
                      "it again to finish)", (unsigned long long)key);
        return NULL;
    }
    return r;
}

/* The outer key of a child key on NIC nic for region index idx. */
static uint64_t outer(uint32_t idx, uint32_t nic, uint64_t child_key)
{
    return VM_KEY(idx, nic, VM_KEY_LOW(child_key));
}

/* On every NIC (all or nothing: a region lives on every NIC or on none). fd >= -1: device
 * memory (reg_device), else host memory (reg). */
static int reg_all(vm_transport *t, int device, int fd, uint64_t offset, void *addr, uint64_t len,
                   uint64_t *key_out, uint32_t *method_out)
{
    pthread_mutex_lock(&t->mu);
    uint32_t i = 0;
    while (i < VM_MAX_REGIONS && t->regions[i].used)
        i++;
    int rc = 0;
    if (i == VM_MAX_REGIONS) {
        vb_fail(NULL, "verbs: too many regions (%d)", VM_MAX_REGIONS);
        rc = -ENOSPC;
    }
    vm_region r = {.used = 1, .len = len, .live = (uint32_t)((1ull << t->num_nics) - 1)};
    uint32_t n = 0, method = 0;
    for (; !rc && n < t->num_nics; n++) {
        pdkv_transport *c = t->nic[n];
        uint32_t m = 0;
        rc = device ? c->ops->reg_device(c, fd, offset, len, addr, &r.child_key[n], &m)
                    : c->ops->reg(c, addr, len, &r.child_key[n]);
        method = method ? method : m;
    }
    if (rc) {
        char why[600];
        snprintf(why, sizeof why, "%s", vb_errbuf());
        for (uint32_t k = 0; k + 1 < n; k++)
            t->nic[k]->ops->dereg(t->nic[k], r.child_key[k]);
        if (n)
            vb_fail(NULL, "%s (on NIC %s)", why, t->names[n - 1]);
    } else {
        t->regions[i] = r;
        *key_out = outer(i, 0, r.child_key[0]);
        if (method_out)
            *method_out = method;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int vm_reg(pdkv_transport *base, void *addr, uint64_t len, uint64_t *key_out)
{
    return reg_all((vm_transport *)base, 0, -1, 0, addr, len, key_out, NULL);
}

int vm_reg_device(pdkv_transport *base, int fd, uint64_t offset, uint64_t len, void *addr,
                  uint64_t *key_out, uint32_t *method_out)
{
    return reg_all((vm_transport *)base, 1, fd, offset, addr, len, key_out, method_out);
}

int vm_nic_key(pdkv_transport *base, uint64_t key, uint32_t nic, uint64_t *key_out)
{
    vm_transport *t = (vm_transport *)base;
    pthread_mutex_lock(&t->mu);
    vm_region *r = vm_find_region(t, key);
    int rc = r ? 0 : -ENOENT;
    if (r && nic >= t->num_nics) {
        vb_fail(NULL, "verbs: NIC %u does not exist: this transport drives %u NICs", nic, t->num_nics);
        rc = -EINVAL;
    } else if (r) {
        *key_out = outer((uint32_t)(r - t->regions), nic, r->child_key[nic]);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* A grant call on the NIC the key names; *key_out (may be NULL) in outer form. */
static int on_nic(vm_transport *t, uint64_t key, int kind, uint64_t peer, uint64_t off, uint64_t len,
                  uint64_t *key_out)
{
    pthread_mutex_lock(&t->mu);
    vm_region *r = vm_find_region(t, key);
    int rc = -ENOENT;
    uint64_t got = 0;
    if (r) {
        uint32_t n = VM_KEY_NIC(key);
        pdkv_transport *c = t->nic[n];
        uint64_t ck = r->child_key[n];
        switch (kind) {
        case 0: rc = c->ops->grant(c, ck, peer, &got); break;
        case 1: rc = c->ops->revoke(c, ck, peer); break;
        case 2: rc = c->ops->grant_range(c, ck, peer, off, len, &got); break;
        default: rc = c->ops->revoke_range(c, ck, peer, off, len); break;
        }
        if (!rc && key_out)
            *key_out = outer((uint32_t)(r - t->regions), n, got);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int vm_grant(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t *key_out)
{
    return on_nic((vm_transport *)t, key, 0, peer, 0, 0, key_out);
}

int vm_revoke(pdkv_transport *t, uint64_t key, uint64_t peer)
{
    return on_nic((vm_transport *)t, key, 1, peer, 0, 0, NULL);
}

int vm_grant_range(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                   uint64_t *key_out)
{
    return on_nic((vm_transport *)t, key, 2, peer, off, len, key_out);
}

int vm_revoke_range(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len)
{
    return on_nic((vm_transport *)t, key, 3, peer, off, len, NULL);
}

/* All or retry. Writes in flight are checked on every NIC first (under each NIC's lock; posts
 * hold t->mu, so none starts meanwhile): then nothing is deregistered (-EBUSY, retry). Else
 * every live NIC's MR is deregistered; a NIC that still says EBUSY keeps its MR and its bit in
 * `live`, the others' are gone and cleared, the region is dying and -EBUSY names the busy NICs:
 * the next call deregisters only what is left, and the region is forgotten once nothing is. */
int vm_dereg(pdkv_transport *base, uint64_t key)
{
    vm_transport *t = (vm_transport *)base;
    pthread_mutex_lock(&t->mu);
    vm_region *r = find_any(t, key);
    int rc = r ? 0 : -ENOENT;
    for (uint32_t n = 0; r && !rc && n < t->num_nics; n++) {
        if (!(r->live >> n & 1))
            continue;
        vb_transport *c = (vb_transport *)t->nic[n];
        pthread_mutex_lock(&c->mu);
        vb_region *cr = vb_find_region(c, r->child_key[n]);
        if (cr && cr->inflight) {
            vb_fail(NULL, "verbs: region 0x%llx has %u writes in flight on NIC %s", (unsigned long long)key,
                    cr->inflight, t->names[n]);
            rc = -EBUSY;
        }
        pthread_mutex_unlock(&c->mu);
    }
    char busy[VM_MAX_NICS * 66] = "";
    int failed = 0;
    for (uint32_t n = 0; r && !rc && n < t->num_nics; n++) {
        if (!(r->live >> n & 1))
            continue;
        int e = t->nic[n]->ops->dereg(t->nic[n], r->child_key[n]);
        if (e == -EBUSY) { /* still registered there: retried by the next call */
            size_t at = strlen(busy);
            snprintf(busy + at, sizeof busy - at, "%s%s", at ? ", " : "", t->names[n]);
            continue;
        }
        r->live &= ~(1u << n); /* gone on NIC n (an error other than busy drops its state too) */
        r->dying = 1;
        failed = failed ? failed : e;
    }
    if (r && !rc && busy[0]) {
        vb_fail(NULL, "verbs: region 0x%llx is still registered on NIC(s) %s (busy); gone from the "
                      "others, no new writes: deregister it again to finish", (unsigned long long)key, busy);
        rc = -EBUSY;
    } else if (r && !rc) {
        memset(r, 0, sizeof *r);
        rc = failed;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}
#endif /* PDKV_HAVE_VERBS */
