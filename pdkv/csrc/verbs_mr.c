/* pdkv verbs transport: memory regions (register, grant, deregister).
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

vb_region *vb_find_region(vb_transport *t, uint64_t key)
{
    uint64_t idx = (key >> 44);
    if (!idx || idx > t->num_regions || !t->regions[idx - 1].mr || t->regions[idx - 1].key != key)
        return NULL;
    return &t->regions[idx - 1];
}

int vb_reg(pdkv_transport *base, void *addr, uint64_t len, uint64_t *key_out)
{
    vb_transport *t = (vb_transport *)base;
    if (!addr || !len) {
        vb_fail(t, "verbs: cannot register an empty region (addr %p, len %llu)", addr,
                (unsigned long long)len);
        return -EINVAL;
    }
    uint64_t pgoff = (uintptr_t)addr & 4095;
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    struct ibv_mr *mr = ibv_reg_mr_iova(t->pd, addr, len, pgoff, access);
    if (!mr) {
        int e = errno ? errno : ENOMEM;
        vb_fail(t, "verbs: ibv_reg_mr(%p, %llu) failed: %s", addr, (unsigned long long)len,
                strerror(e));
        return -e;
    }
    pthread_mutex_lock(&t->mu);
    uint32_t i = 0;
    while (i < t->num_regions && t->regions[i].mr)
        i++;
    if (i == t->num_regions) {
        vb_region *r = i < (1u << 20) - 1 ? realloc(t->regions, (i + 1) * sizeof *r) : NULL;
        if (!r) {
            pthread_mutex_unlock(&t->mu);
            ibv_dereg_mr(mr);
            vb_fail(t, "verbs: too many regions");
            return -ENOMEM;
        }
        t->regions = r;
        t->num_regions++;
    }
    vb_region *r = &t->regions[i];
    r->mr = mr;
    r->len = len;
    r->inflight = 0;
    r->key = (uint64_t)(i + 1) << 44 | pgoff << 32 | mr->rkey;
    *key_out = r->key;
    pthread_mutex_unlock(&t->mu);
    return 0;
}

/* The rkey is the grant: the NIC enforces it. Only check that the key is ours. */
int vb_grant(pdkv_transport *base, uint64_t key, uint64_t peer)
{
    vb_transport *t = (vb_transport *)base;
    pthread_mutex_lock(&t->mu);
    int ok = vb_find_region(t, key) != NULL;
    pthread_mutex_unlock(&t->mu);
    if (!ok) {
        vb_fail(t, "verbs: grant of unknown key 0x%llx", (unsigned long long)key);
        return -ENOENT;
    }
    return 0;
}

int vb_dereg(pdkv_transport *base, uint64_t key)
{
    vb_transport *t = (vb_transport *)base;
    pthread_mutex_lock(&t->mu);
    vb_region *r = vb_find_region(t, key);
    int rc = 0;
    if (!r) {
        vb_fail(t, "verbs: dereg of unknown key 0x%llx", (unsigned long long)key);
        rc = -ENOENT;
    } else if (r->inflight) {
        vb_fail(t, "verbs: region 0x%llx has %u writes in flight", (unsigned long long)key,
                r->inflight);
        rc = -EBUSY;
    } else if (ibv_dereg_mr(r->mr)) {
        vb_fail(t, "verbs: ibv_dereg_mr failed: %s", strerror(errno));
        rc = -EIO;
    } else {
        r->mr = NULL;
        r->key = 0;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

#endif /* PDKV_HAVE_VERBS */
