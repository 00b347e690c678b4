/* Shared hand-off (shm transport): local pages that are a peer's granted pages.
 *
 * share_pages puts the granted memory itself at a local address (mremap with old size 0 makes a
 * second mapping of a shared mapping's pages), so what this process computes there is already
 * in the peer and the write that follows moves nothing. The local address range keeps its
 * region's identity: unsharing maps the region's own file back over it (its contents from
 * before; a write source's pages come back zeroed), and every exit of the grant (revoke,
 * disconnect, destroy) unshares first, so no alias outlives the grant it was made from. All under
 * c->map_mu.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "shm_internal.h"

static shm_file *local_file(shm_t *t, uint64_t lkey) {
    for (uint32_t i = 0; i < t->num_files; i++)
        if (t->files[i].key == lkey) return &t->files[i];
    return NULL;
}

/* Give [a, a+len) of region lkey its own file's pages back; if that region is gone (deregistered)
 * or a write source (no file), fresh anonymous memory: never the peer's pages. */
static void restore(shm_t *t, uint64_t lkey, uint8_t *a, uint64_t len) {
    uint64_t at = (uint64_t)a, end = at + len;
    pthread_mutex_lock(&t->mu);
    const shm_file *f = local_file(t, lkey);
    while (f && at < end) {
        const shm_seg *s = NULL;
        for (uint32_t i = 0; i < f->nseg && !s; i++)
            if (f->seg[i].va0 <= at && at < f->seg[i].va1) s = &f->seg[i];
        uint64_t stop = s && s->va1 < end ? s->va1 : end;
        if (!s || mmap((void *)at, stop - at, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, s->fd,
                       (off_t)(s->foff + (at - s->va0))) == MAP_FAILED)
            break;
        at = stop;
    }
    pthread_mutex_unlock(&t->mu);
    if (at < end) /* what could not get its own pages back gets zeroed ones, never the peer's */
        mmap((void *)at, end - at, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
}

int pdkv_shm_alias(shm_conn *c, const shm_map *m, uint64_t lkey, uint64_t loff, uint64_t rkey, uint64_t roff,
                   uint64_t len, char *why, size_t n) {
    const uint64_t pg = pdkv_shm_page();
    shm_t *t = c->owner;
    pthread_mutex_lock(&t->mu);
    shm_file *f = local_file(t, lkey);
    uint64_t laddr = f ? f->addr + loff : 0, at = laddr;
    /* the local range must be pages of this region's own files (a write source: whole pages inside
     * the region, whose edges may share a page with other memory): nothing else is ever replaced */
    for (uint32_t i = 0; f && i < f->nseg; i++)
        for (uint32_t k = 0; k < f->nseg; k++)
            if (f->seg[k].va0 <= at && at < f->seg[k].va1) at = f->seg[k].va1;
    if (f && f->source) at = f->addr + f->len;
    pthread_mutex_unlock(&t->mu);
    if (!f) return pdkv_seterr(why, n, -ENOENT, "share_pages: unknown local region key 0x%llx",
                               (unsigned long long)lkey);
    if (len > UINT64_MAX - laddr || at < laddr + len)
        return pdkv_seterr(why, n, -ERANGE, "share_pages: [%llu, +%llu) is outside local region 0x%llx",
                           (unsigned long long)loff, (unsigned long long)len, (unsigned long long)lkey);
    uint8_t *remote = m->at + (roff - m->off);
    if (!len || len % pg || laddr % pg || (uint64_t)remote % pg)
        return pdkv_seterr(why, n, -EINVAL, "share_pages: [%llu, +%llu) is not whole pages of %llu bytes on "
                           "both sides (local %#llx, peer %#llx)", (unsigned long long)loff,
                           (unsigned long long)len, (unsigned long long)pg, (unsigned long long)laddr,
                           (unsigned long long)(uintptr_t)remote);
    if (c->num_aliases == c->cap_aliases) {
        uint32_t cap = c->cap_aliases ? 2 * c->cap_aliases : 64;
        shm_alias *a = cap <= PDKV_MAX_RANGES ? realloc(c->aliases, cap * sizeof *a) : NULL;
        if (!a) return pdkv_seterr(why, n, -ENOMEM, "share_pages: too many shared ranges (%u)", c->num_aliases);
        c->aliases = a, c->cap_aliases = cap;
    }
    /* one mremap per piece of the grant: each piece is one file, one mapping */
    uint64_t r0 = (uint64_t)(remote - m->base), done = 0;
    while (done < len) {
        uint64_t cut = m->base_len;
        for (uint32_t i = 0; i < m->num_cuts; i++)
            if (m->cuts[i] > r0 + done && m->cuts[i] < cut) cut = m->cuts[i];
        uint64_t part = cut - (r0 + done) < len - done ? cut - (r0 + done) : len - done;
        void *got = mremap(remote + done, 0, part, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)(laddr + done));
        if (got == MAP_FAILED) {
            int e = errno;
            if (done) restore(t, lkey, (uint8_t *)laddr, done);
            return pdkv_seterr(why, n, -e, "share_pages: mapping %llu granted bytes at %#llx: %s",
                               (unsigned long long)part, (unsigned long long)(laddr + done), strerror(e));
        }
        done += part;
    }
    c->aliases[c->num_aliases++] = (shm_alias){lkey, loff, len, rkey, roff, m->key, m->off, m->len,
                                               (uint8_t *)laddr};
    return 0;
}

static void drop_alias(shm_conn *c, uint32_t i) {
    shm_alias a = c->aliases[i];
    c->aliases[i] = c->aliases[--c->num_aliases];
    restore(c->owner, a.lkey, a.local, a.len);
}

void pdkv_shm_unalias_map(shm_conn *c, const shm_map *m) {
    for (uint32_t i = c->num_aliases; i-- > 0;) {
        const shm_alias *a = &c->aliases[i];
        if (!m || (a->mkey == m->key && a->moff == m->off && a->mlen == m->len)) drop_alias(c, i);
    }
}

int pdkv_shm_unalias(shm_conn *c, uint64_t lkey, uint64_t loff, uint64_t len) {
    int k = 0;
    for (uint32_t i = c->num_aliases; i-- > 0;) {
        const shm_alias *a = &c->aliases[i];
        if (a->lkey == lkey && a->loff >= loff && a->len <= len && a->loff - loff <= len - a->len)
            drop_alias(c, i), k++;
    }
    return k;
}

int pdkv_shm_is_shared(const shm_conn *c, const pdkv_write *w) {
    for (uint32_t i = 0; i < c->num_aliases; i++) {
        const shm_alias *a = &c->aliases[i];
        if (a->lkey == w->lkey && a->rkey == w->rkey && w->loff >= a->loff && w->len <= a->len &&
            w->loff - a->loff <= a->len - w->len && w->roff - a->roff == w->loff - a->loff &&
            w->roff >= a->roff)
            return 1;
    }
    return 0;
}
