/* Same-host transport over shared memory: grants are mappings (see shm_internal.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "shm.h"
#include "shm_internal.h"

#define SHM_INFO_MAGIC 0x4d485350u /* "PSHM" */
#define IMM_PER_MSG 512

typedef struct shm_info {
    uint32_t magic, pad;
    uint64_t node_id;
    char host[80];
    char name[108];
} shm_info;

static __thread char tls_err[PDKV_ERR_MAX];

static int serr(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof tls_err, fmt, ap);
    va_end(ap);
    return code;
}

static socklen_t addr_of(const char *name, struct sockaddr_un *a) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    size_t n = strnlen(name + 1, sizeof a->sun_path - 1) + 1; /* abstract: name[0] == 0 */
    memcpy(a->sun_path, name, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
}

static int send_fds(int fd, const shm_hdr *h, const void *p, size_t plen, const int *fds, int nfds) {
    struct iovec iov[2] = {{(void *)h, sizeof *h}, {(void *)p, plen}};
    char ctl[CMSG_SPACE(sizeof(int) * SHM_MAX_SEGS)];
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = plen ? 2 : 1};
    if (nfds > 0) {
        memset(ctl, 0, sizeof ctl);
        m.msg_control = ctl;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS, c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    /* never blocks for long: a peer that stopped reading (frozen, or its listener stuck) fails
     * this after SHM_REPLY_MS instead of stalling the poster's thread for good */
    for (int waited = 0;;) {
        ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r >= 0) return 0;
        if (errno == EINTR) continue;
        if (errno != EAGAIN || waited >= SHM_REPLY_MS) return -errno;
        struct pollfd pf = {fd, POLLOUT, 0};
        poll(&pf, 1, 100);
        waited += 100;
    }
}

static int send_msg(int fd, const shm_hdr *h, const void *p, size_t plen, int pass_fd) {
    return send_fds(fd, h, p, plen, &pass_fd, pass_fd >= 0 ? 1 : 0);
}

/* One message: its payload length (>= 0) or -errno; fd_in[0..SHM_MAX_SEGS) the passed
 * descriptors in order (-1 past the last; fd_in NULL: none wanted, any that came are closed). */
static ssize_t recv_msg(int fd, shm_hdr *h, void *p, size_t cap, int *fd_in, int timeout_ms) {
    if (fd_in)
        for (int i = 0; i < SHM_MAX_SEGS; i++) fd_in[i] = -1;
    if (timeout_ms >= 0) {
        struct pollfd pf = {fd, POLLIN, 0};
        int r;
        do r = poll(&pf, 1, timeout_ms);
        while (r < 0 && errno == EINTR);
        if (r == 0) return -ETIMEDOUT;
    }
    struct iovec iov[2] = {{h, sizeof *h}, {p, cap}};
    char ctl[CMSG_SPACE(sizeof(int) * SHM_MAX_SEGS)];
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = ctl, .msg_controllen = sizeof ctl};
    ssize_t r;
    do r = recvmsg(fd, &m, MSG_CMSG_CLOEXEC | (timeout_ms >= 0 ? 0 : MSG_DONTWAIT));
    while (r < 0 && errno == EINTR);
    if (r < 0) return -errno;
    int got = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
                int f;
                memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
                if (fd_in && got < SHM_MAX_SEGS) fd_in[got++] = f;
                else close(f); /* never keep a stray one */
            }
    if (r == 0 || (size_t)r < sizeof *h || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        for (int i = 0; fd_in && i < got; i++) close(fd_in[i]), fd_in[i] = -1;
        return r == 0 ? -ECONNRESET : -EPROTO;
    }
    return r - (ssize_t)sizeof *h;
}

static shm_conn *conn_of(shm_t *t, uint32_t id) {
    return id >= 1 && id <= t->num_conns ? &t->conns[id - 1] : NULL;
}

static shm_file *file_of(shm_t *t, uint64_t key) {
    for (uint32_t i = 0; i < t->num_files; i++)
        if (t->files[i].key == key) return &t->files[i];
    return NULL;
}

/* ---- writer side: the mappings an owner granted us ---- */

static void unmap_at(shm_conn *c, uint32_t i) {
    pdkv_shm_unalias_map(c, &c->maps[i]); /* no local page stays the peer's once its grant ends */
    munmap(c->maps[i].base, c->maps[i].base_len);
    c->maps[i] = c->maps[--c->num_maps];
}

static void unmap_all(shm_conn *c) {
    pthread_mutex_lock(&c->map_mu);
    while (c->num_maps) unmap_at(c, c->num_maps - 1);
    pthread_mutex_unlock(&c->map_mu);
}

/* Map the granted range: h->len bytes of the region's pages as pieces of its files, laid out
 * contiguously (a PROT_NONE reservation, each piece MAP_FIXED into it); h->file_off: where the
 * range starts in that mapping. */
static int do_map(shm_conn *c, const shm_hdr *h, const shm_piece *pc, uint32_t np, const int *fds,
                  char *why, size_t n) {
    const uint64_t pg = pdkv_shm_page();
    uint64_t total = 0;
    if (!np || np > SHM_MAX_SEGS || !h->len)
        return pdkv_seterr(why, n, -EPROTO, "malformed grant of key 0x%llx", (unsigned long long)h->key);
    for (uint32_t i = 0; i < np; i++) {
        struct stat st;
        if (fds[i] < 0) return pdkv_seterr(why, n, -EPROTO, "grant of key 0x%llx came without its memory",
                                           (unsigned long long)h->key);
        if (pc[i].at != total || pc[i].len % pg || pc[i].foff % pg || !pc[i].len)
            return pdkv_seterr(why, n, -EPROTO, "malformed grant piece %u of key 0x%llx", i,
                               (unsigned long long)h->key);
        if (fstat(fds[i], &st) < 0 || (uint64_t)st.st_size < pc[i].foff + pc[i].len) /* would SIGBUS */
            return pdkv_seterr(why, n, -ERANGE, "granted piece ends at byte %llu of a %lld-byte region file",
                               (unsigned long long)(pc[i].foff + pc[i].len), (long long)st.st_size);
        total += pc[i].len;
    }
    if (h->file_off > total || h->len > total - h->file_off)
        return pdkv_seterr(why, n, -EPROTO, "granted range [%llu, +%llu) exceeds its %llu mapped bytes",
                           (unsigned long long)h->file_off, (unsigned long long)h->len, (unsigned long long)total);
    pthread_mutex_lock(&c->map_mu);
    for (uint32_t i = 0; i < c->num_maps; i++)
        if (c->maps[i].key == h->key && c->maps[i].off == h->off && c->maps[i].len == h->len) {
            pthread_mutex_unlock(&c->map_mu);
            return 0; /* granted again (the replay at connect): already mapped */
        }
    int rc = 0;
    if (c->num_maps == c->cap_maps) {
        uint32_t cap = c->cap_maps ? 2 * c->cap_maps : 64;
        shm_map *m = cap <= PDKV_MAX_RANGES ? realloc(c->maps, cap * sizeof *m) : NULL;
        if (!m) rc = pdkv_seterr(why, n, -ENOMEM, "too many granted ranges (%u)", c->num_maps);
        else c->maps = m, c->cap_maps = cap;
    }
    uint8_t *base = MAP_FAILED;
    if (!rc) {
        base = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED)
            rc = pdkv_seterr(why, n, -errno, "reserving %llu bytes for a grant: %s", (unsigned long long)total,
                             strerror(errno));
    }
    for (uint32_t i = 0; !rc && i < np; i++)
        if (mmap(base + pc[i].at, pc[i].len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fds[i],
                 (off_t)pc[i].foff) == MAP_FAILED)
            rc = pdkv_seterr(why, n, -errno, "mapping %llu granted bytes: %s", (unsigned long long)pc[i].len,
                             strerror(errno));
    if (!rc) {
        shm_map *m = &c->maps[c->num_maps++];
        *m = (shm_map){h->key, h->off, h->len, base, total, base + h->file_off, 0, {0}};
        for (uint32_t i = 1; i < np; i++) m->cuts[m->num_cuts++] = pc[i].at;
    }
    else if (base != MAP_FAILED)
        munmap(base, total);
    pthread_mutex_unlock(&c->map_mu);
    return rc;
}

static int do_unmap(shm_conn *c, const shm_hdr *h, int whole_key) {
    int found = 0;
    pthread_mutex_lock(&c->map_mu); /* waits for a memcpy into it to finish */
    for (uint32_t i = c->num_maps; i-- > 0;)
        if (c->maps[i].key == h->key && (whole_key || (c->maps[i].off == h->off && c->maps[i].len == h->len)))
            unmap_at(c, i), found = 1;
    pthread_mutex_unlock(&c->map_mu);
    return found || whole_key ? 0 : -ENOENT;
}

/* ---- owner side: grants become mappings in the peer ---- */

static shm_conn *live_conn(shm_t *t, uint64_t peer) {
    for (uint32_t i = t->num_conns; i-- > 0;)
        if (t->conns[i].peer == peer && t->conns[i].state == 2 && t->conns[i].out_fd >= 0) return &t->conns[i];
    return NULL;
}

/* Wait for the answer to the request just sent on c->out_fd (rc: the send's result); called
 * with c->out_mu held, releases it. */
static int finish_request(shm_conn *c, int rc, shm_hdr *r, char *reason, size_t cap) {
    ssize_t got = 0;
    if (!rc) {
        got = recv_msg(c->out_fd, r, reason, cap - 1, NULL, SHM_REPLY_MS);
        if (got < 0) rc = (int)got;
        else if (r->type != SHM_ACK) rc = -EPROTO;
    }
    if (rc < 0) { /* a peer that cannot answer is dropped: it unmaps everything when it sees that */
        if (c->out_fd >= 0) shutdown(c->out_fd, SHUT_RDWR);
        pthread_mutex_unlock(&c->out_mu);
        return serr(rc, "shm: peer %llu did not answer (%s): connection dropped", (unsigned long long)c->peer,
                    strerror(-rc));
    }
    pthread_mutex_unlock(&c->out_mu);
    if ((int32_t)r->n < 0) {
        reason[got] = 0;
        return serr((int32_t)r->n, "shm: peer %llu could not map the grant: %s", (unsigned long long)c->peer,
                    reason);
    }
    return 0;
}

/* Ask the peer of c to unmap, and wait for its answer. */
static int request(shm_conn *c, shm_hdr *h) {
    char reason[PDKV_REASON_MAX];
    shm_hdr r;
    pthread_mutex_lock(&c->out_mu);
    int rc = c->out_fd < 0 ? -ENOTCONN : send_msg(c->out_fd, h, NULL, 0, -1);
    return finish_request(c, rc, &r, reason, sizeof reason);
}

static int map_in_peer(shm_t *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len) {
    const uint64_t pg = pdkv_shm_page();
    shm_piece pc[SHM_MAX_SEGS];
    int fds[SHM_MAX_SEGS], np = 0;
    pthread_mutex_lock(&t->mu);
    shm_conn *c = live_conn(t, peer);
    shm_file *f = file_of(t, key);
    uint64_t g0 = 0;
    if (f) { /* the granted bytes, page-rounded, as pieces of the region's files */
        uint64_t a = f->addr + off;
        g0 = a & ~(pg - 1);
        uint64_t g1 = (a + len + pg - 1) & ~(pg - 1), at = 0;
        for (uint32_t i = 0; i < f->nseg; i++) {
            const shm_seg *s = &f->seg[i];
            uint64_t p0 = s->va0 > g0 ? s->va0 : g0, p1 = s->va1 < g1 ? s->va1 : g1;
            if (p0 >= p1) continue;
            pc[np] = (shm_piece){at, p1 - p0, s->foff + (p0 - s->va0)};
            fds[np++] = s->fd;
            at += p1 - p0;
        }
        g0 = a - g0; /* where the range starts in the writer's mapping */
    }
    shm_hdr h = {.type = SHM_MAP, .n = (uint32_t)np, .key = key, .off = off, .len = len, .file_off = g0};
    if (!c || !f) {
        pthread_mutex_unlock(&t->mu);
        /* not connected yet: complete() maps what is granted by then */
        return f ? 0 : serr(-ENOENT, "shm: unknown region key 0x%llx", (unsigned long long)key);
    }
    /* the fds stay open while t->mu is held: a dereg racing this cannot close them under us */
    char reason[PDKV_REASON_MAX];
    shm_hdr r;
    pthread_mutex_lock(&c->out_mu);
    int rc = c->out_fd < 0 ? -ENOTCONN : send_fds(c->out_fd, &h, pc, (size_t)np * sizeof *pc, fds, np);
    pthread_mutex_unlock(&t->mu);
    return finish_request(c, rc, &r, reason, sizeof reason);
}

static int unmap_in_peer(shm_t *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len, int type) {
    pthread_mutex_lock(&t->mu);
    shm_conn *c = live_conn(t, peer);
    pthread_mutex_unlock(&t->mu);
    shm_hdr h = {.type = (uint32_t)type, .key = key, .off = off, .len = len};
    /* no connection, or a dropped one: the peer holds no mapping (it unmaps all at disconnect) */
    return c ? request(c, &h) == -ENOENT ? -ENOENT : 0 : 0;
}

static uint64_t region_len(shm_t *t, uint64_t key) {
    for (uint32_t i = 0; i < t->regions.cap; i++)
        if (t->regions.slots[i].key == key) return t->regions.slots[i].len;
    return 0;
}

static int s_reg(pdkv_transport *bt, void *addr, uint64_t len, uint64_t *key) {
    shm_t *t = (shm_t *)bt;
    shm_file f;
    if (!len) return serr(-EINVAL, "shm: cannot register an empty region");
    int rc = pdkv_shm_share(t->dir, (int)t->lazy_alloc, addr, len, &f, tls_err, sizeof tls_err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&t->mu);
    if (t->num_files == SHM_MAX_FDS) rc = serr(-ENOSPC, "shm: at most %d registered regions", SHM_MAX_FDS);
    else rc = pdkv_regions_add(&t->regions, addr, len, key, tls_err, sizeof tls_err);
    if (!rc) f.key = *key, t->files[t->num_files++] = f;
    pthread_mutex_unlock(&t->mu);
    if (rc)
        for (uint32_t i = 0; i < f.nseg; i++) close(f.seg[i].fd);
    return rc;
}

/* A write source only: its memory stays as it is (private pages allocated as they are touched),
 * so no peer can map it; the shared hand-off may still put granted pages over its whole pages. */
static int s_reg_source(pdkv_transport *bt, void *addr, uint64_t len, uint64_t *key) {
    shm_t *t = (shm_t *)bt;
    if (!len) return serr(-EINVAL, "shm: cannot register an empty region");
    pthread_mutex_lock(&t->mu);
    int rc = t->num_files == SHM_MAX_FDS ? serr(-ENOSPC, "shm: at most %d registered regions", SHM_MAX_FDS)
                                         : pdkv_regions_add(&t->regions, addr, len, key, tls_err, sizeof tls_err);
    if (!rc) t->files[t->num_files++] = (shm_file){.key = *key, .addr = (uint64_t)addr, .len = len, .source = 1};
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* -EPERM for a region registered as a write source only. */
static int refuse_source(shm_t *t, uint64_t k) {
    pthread_mutex_lock(&t->mu);
    shm_file *f = file_of(t, k);
    int source = f && f->source;
    pthread_mutex_unlock(&t->mu);
    return source ? serr(-EPERM, "shm: region 0x%llx was registered as a write source only: it cannot be "
                         "granted to a peer", (unsigned long long)k) : 0;
}

static int s_grant(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t *out) {
    shm_t *t = (shm_t *)bt;
    if (out) *out = k;
    if (refuse_source(t, k) < 0) return -EPERM;
    int rc = pdkv_regions_grant(&t->regions, k, p, tls_err, sizeof tls_err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&t->regions.mu);
    uint64_t len = region_len(t, k);
    pthread_mutex_unlock(&t->regions.mu);
    rc = map_in_peer(t, k, p, 0, len);
    if (rc < 0) {
        char keep[PDKV_ERR_MAX];
        snprintf(keep, sizeof keep, "%s", tls_err);
        pdkv_regions_revoke(&t->regions, k, p, tls_err, sizeof tls_err);
        snprintf(tls_err, sizeof tls_err, "%s", keep);
    }
    return rc;
}

static int s_revoke(pdkv_transport *bt, uint64_t k, uint64_t p) {
    shm_t *t = (shm_t *)bt;
    int rc = pdkv_regions_revoke(&t->regions, k, p, tls_err, sizeof tls_err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&t->regions.mu);
    uint64_t len = region_len(t, k);
    pthread_mutex_unlock(&t->regions.mu);
    unmap_in_peer(t, k, p, 0, len, SHM_UNMAP);
    return 0;
}

static int s_grant_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len, uint64_t *out) {
    shm_t *t = (shm_t *)bt;
    if (out) *out = k;
    if (refuse_source(t, k) < 0) return -EPERM;
    int rc = pdkv_regions_grant_range(&t->regions, k, p, off, len, tls_err, sizeof tls_err);
    if (rc < 0) return rc;
    rc = map_in_peer(t, k, p, off, len);
    if (rc < 0) {
        char keep[PDKV_ERR_MAX];
        snprintf(keep, sizeof keep, "%s", tls_err);
        pdkv_regions_revoke_range(&t->regions, k, p, off, len, tls_err, sizeof tls_err);
        snprintf(tls_err, sizeof tls_err, "%s", keep);
    }
    return rc;
}

static int s_revoke_range(pdkv_transport *bt, uint64_t k, uint64_t p, uint64_t off, uint64_t len) {
    shm_t *t = (shm_t *)bt;
    int rc = pdkv_regions_revoke_range(&t->regions, k, p, off, len, tls_err, sizeof tls_err);
    if (rc < 0) return rc;
    unmap_in_peer(t, k, p, off, len, SHM_UNMAP);
    return 0;
}

static int s_dereg(pdkv_transport *bt, uint64_t k) {
    shm_t *t = (shm_t *)bt;
    int rc = pdkv_regions_remove(&t->regions, k, tls_err, sizeof tls_err);
    if (rc < 0) return rc;
    uint64_t peers[SHM_MAX_CONNS];
    uint32_t np = 0;
    pthread_mutex_lock(&t->mu);
    for (uint32_t i = 0; i < t->num_conns; i++)
        if (t->conns[i].state == 2) peers[np++] = t->conns[i].peer;
    shm_file *f = file_of(t, k);
    if (f) {
        for (uint32_t i = 0; i < f->nseg; i++) close(f->seg[i].fd);
        *f = t->files[--t->num_files];
    }
    pthread_mutex_unlock(&t->mu);
    for (uint32_t i = 0; i < np; i++) unmap_in_peer(t, k, peers[i], 0, 0, SHM_UNMAP_KEY);
    return 0;
}

/* ---- connections ---- */

static int s_prepare(pdkv_transport *bt, uint64_t peer, void *info, uint32_t *len, uint32_t *conn) {
    shm_t *t = (shm_t *)bt;
    pthread_mutex_lock(&t->mu);
    if (t->num_conns == SHM_MAX_CONNS) {
        pthread_mutex_unlock(&t->mu);
        return serr(-ENOSPC, "shm transport: at most %d connections", SHM_MAX_CONNS);
    }
    shm_conn *c = &t->conns[t->num_conns];
    c->peer = peer, c->state = 1, c->out_fd = c->in_fd = -1, c->token_len = 0;
    *conn = ++t->num_conns;
    pthread_mutex_unlock(&t->mu);
    shm_info i = {.magic = SHM_INFO_MAGIC, .node_id = t->base.node_id};
    memcpy(i.host, t->host, sizeof i.host);
    memcpy(i.name, t->name, sizeof i.name);
    memcpy(info, &i, sizeof i);
    *len = sizeof i;
    return 0;
}

static int s_set_token(pdkv_transport *bt, uint32_t id, const void *tok, uint32_t len) {
    shm_t *t = (shm_t *)bt;
    shm_conn *c = conn_of(t, id);
    if (!c || c->state != 1) return serr(-EINVAL, "shm connection %u is not prepared", id);
    if (len < 16 || len > SHM_TOKEN_MAX) return serr(-EINVAL, "shm token must be 16..32 bytes, got %u", len);
    memcpy(c->token, tok, len);
    c->token_len = len;
    return 0;
}

static int s_complete(pdkv_transport *bt, uint32_t id, const void *info, uint32_t len) {
    shm_t *t = (shm_t *)bt;
    shm_conn *c = conn_of(t, id);
    shm_info i;
    if (!c || c->state != 1) return serr(-EINVAL, "shm connection %u is not prepared", id);
    if (len != sizeof i) return serr(-EINVAL, "shm connection info must be %zu bytes, got %u", sizeof i, len);
    memcpy(&i, info, sizeof i);
    i.host[sizeof i.host - 1] = 0;
    if (i.magic != SHM_INFO_MAGIC) return serr(-EINVAL, "not shm connection info");
    if (i.node_id != c->peer)
        return serr(-EINVAL, "connection info is from node %llu, expected %llu", (unsigned long long)i.node_id,
                    (unsigned long long)c->peer);
    if (strcmp(i.host, t->host))
        return serr(-EHOSTUNREACH, "shm: peer %llu is on another host (boot id %s, here %s)",
                    (unsigned long long)c->peer, i.host, t->host);
    struct sockaddr_un a;
    socklen_t alen = addr_of(i.name, &a);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return serr(-errno, "shm: socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&a, alen) < 0) {
        int e = errno;
        close(fd);
        return serr(-e, "shm: cannot reach peer %llu's socket @%s (%s): not this host or another network "
                    "namespace", (unsigned long long)c->peer, i.name + 1, strerror(e));
    }
    shm_hdr h = {.type = SHM_HELLO, .n = c->token_len, .node_id = t->base.node_id};
    int rc = send_msg(fd, &h, c->token, c->token_len, -1);
    if (rc < 0) {
        close(fd);
        return serr(rc, "shm: hello to peer %llu: %s", (unsigned long long)c->peer, strerror(-rc));
    }
    pthread_mutex_lock(&t->mu);
    c->out_fd = fd;
    c->state = 2;
    pthread_mutex_unlock(&t->mu);
    /* what was granted to this peer before it connected is mapped there now */
    typedef struct { uint64_t key, off, len; } g3;
    g3 *todo = NULL;
    uint32_t nt = 0, cap = 0;
    pthread_mutex_lock(&t->regions.mu);
    for (uint32_t s = 0; s < t->regions.cap; s++) {
        pdkv_region *r = &t->regions.slots[s];
        for (uint32_t g = 0; r->key && g < r->num_grants; g++) {
            pdkv_grant *gr = &r->grants[g];
            if (gr->peer != c->peer) continue;
            uint32_t need = nt + gr->num_ranges + 1;
            if (need > cap) {
                g3 *m = realloc(todo, (cap = need * 2) * sizeof *m);
                if (!m) break;
                todo = m;
            }
            if (gr->whole) todo[nt++] = (g3){r->key, 0, r->len};
            for (uint32_t k = 0; k < gr->num_ranges; k++) todo[nt++] = (g3){r->key, gr->ranges[k].off, gr->ranges[k].len};
        }
    }
    pthread_mutex_unlock(&t->regions.mu);
    for (uint32_t k = 0; k < nt && !rc; k++) rc = map_in_peer(t, todo[k].key, c->peer, todo[k].off, todo[k].len);
    free(todo);
    return rc;
}

static void drop_conn(shm_t *t, shm_conn *c) {
    pthread_mutex_lock(&c->out_mu);
    if (c->out_fd >= 0) shutdown(c->out_fd, SHUT_RDWR);
    pthread_mutex_unlock(&c->out_mu);
    if (c->in_fd >= 0) shutdown(c->in_fd, SHUT_RDWR); /* the listener closes it */
    unmap_all(c);
    (void)t;
}

static int s_disconnect(pdkv_transport *bt, uint32_t id) {
    shm_t *t = (shm_t *)bt;
    pthread_mutex_lock(&t->mu);
    shm_conn *c = conn_of(t, id);
    if (!c) {
        pthread_mutex_unlock(&t->mu);
        return serr(-ENOENT, "unknown shm connection %u", id);
    }
    c->state = 3;
    pthread_mutex_unlock(&t->mu);
    drop_conn(t, c);
    return 0;
}

/* ---- writes: one memcpy each into the granted mapping, then the immediates to the owner ---- */

static const shm_map *find_map(const shm_conn *c, uint64_t key, uint64_t off, uint64_t len) {
    for (uint32_t i = 0; i < c->num_maps; i++) {
        const shm_map *m = &c->maps[i];
        if (m->key == key && off >= m->off && len <= m->len && off - m->off <= m->len - len) return m;
    }
    return NULL;
}

static int s_post(pdkv_transport *bt, uint32_t id, const pdkv_write *w, int n) {
    shm_t *t = (shm_t *)bt;
    pthread_mutex_lock(&t->mu);
    shm_conn *c = conn_of(t, id);
    int ok = c && c->state == 2 && c->out_fd >= 0;
    pthread_mutex_unlock(&t->mu);
    if (!ok) return serr(-ENOTCONN, "shm connection %u is not connected", id);
    if (n <= 0) return 0;
    const uint8_t **src = malloc((size_t)n * sizeof *src);
    int32_t *st = malloc((size_t)n * sizeof *st);
    shm_imm *imm = malloc((size_t)n * sizeof *imm);
    if (!src || !st || !imm) {
        free(src), free(st), free(imm);
        return serr(-ENOMEM, "shm: out of memory posting %d writes", n);
    }
    int rc = pdkv_regions_pin_writes(&t->regions, w, n, src, tls_err, sizeof tls_err);
    if (rc < 0) {
        free(src), free(st), free(imm);
        return rc;
    }
    int nimm = 0, refused = 0;
    char why[PDKV_REASON_MAX] = "";
    pthread_mutex_lock(&c->map_mu);
    for (int i = 0; i < n; i++) {
        const shm_map *m = find_map(c, w[i].rkey, w[i].roff, w[i].len);
        st[i] = m ? 0 : -EACCES;
        if (!m) { /* nothing of the owner is mapped there: refused before a byte moves */
            if (!refused++)
                snprintf(why, sizeof why, "region 0x%llx [%llu, +%llu) is not granted to peer %llu (not mapped)",
                         (unsigned long long)w[i].rkey, (unsigned long long)w[i].roff,
                         (unsigned long long)w[i].len, (unsigned long long)t->base.node_id);
            continue;
        }
        if (c->num_aliases && pdkv_shm_is_shared(c, &w[i])) { /* computed in place: nothing to move */
            __atomic_add_fetch(&t->shared_writes, 1, __ATOMIC_RELAXED);
        } else {
            memcpy(m->at + (w[i].roff - m->off), src[i], w[i].len);
            __atomic_add_fetch(&t->copied_writes, 1, __ATOMIC_RELAXED);
            __atomic_add_fetch(&t->copied_bytes, w[i].len, __ATOMIC_RELAXED);
        }
        c->writes++, c->bytes += w[i].len;
        if (w[i].has_imm) imm[nimm++] = (shm_imm){w[i].imm, 0, w[i].len};
    }
    pthread_mutex_unlock(&c->map_mu);
    int sent = 0;
    for (int k = 0; k < nimm && sent == 0; k += IMM_PER_MSG) {
        int cnt = nimm - k < IMM_PER_MSG ? nimm - k : IMM_PER_MSG;
        shm_hdr h = {.type = SHM_IMM, .n = (uint32_t)cnt};
        sent = send_msg(c->out_fd, &h, imm + k, (size_t)cnt * sizeof *imm, -1);
    }
    if (refused) { /* as on tcp, a refused write ends the connection; the owner is told first */
        shm_hdr h = {.type = SHM_REFUSED, .n = (uint32_t)refused};
        send_msg(c->out_fd, &h, why, strlen(why), -1);
        pthread_mutex_lock(&t->mu);
        c->state = 3;
        pthread_mutex_unlock(&t->mu);
        drop_conn(t, c);
    }
    for (int i = 0; i < n; i++) {
        pdkv_regions_unpin(&t->regions, w[i].lkey);
        if (st[i] == 0 && sent == 0)
            pdkv_cq_pushf(&t->cq, PDKV_CQ_WRITE_DONE, w[i].wr_id, c->peer, w[i].len, 0, 0, NULL);
        else if (st[i] == 0)
            pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, w[i].wr_id, c->peer, w[i].len, sent, 0,
                          "shm: the peer's completion could not be sent: %s", strerror(-sent));
        else
            pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, w[i].wr_id, c->peer, w[i].len, st[i], 0,
                          "peer %llu refused a write: %s", (unsigned long long)c->peer, why);
    }
    free(src), free(st), free(imm);
    return n;
}

/* ---- the listener: hellos, grants to map, immediates that landed ---- */

static void on_hello(shm_t *t, int fd) {
    shm_hdr h;
    uint8_t tok[SHM_TOKEN_MAX + 1];
    ssize_t got = recv_msg(fd, &h, tok, sizeof tok, NULL, 2000);
    shm_conn *match = NULL;
    pthread_mutex_lock(&t->mu);
    if (got >= 0 && h.type == SHM_HELLO && (size_t)got == h.n)
        for (uint32_t i = t->num_conns; i-- > 0 && !match;) {
            shm_conn *c = &t->conns[i];
            if (c->peer == h.node_id && (c->state == 1 || c->state == 2) && c->in_fd < 0 &&
                c->token_len == h.n && !memcmp(c->token, tok, h.n))
                match = c;
        }
    if (match) match->in_fd = fd;
    else t->refused_conns++;
    pthread_mutex_unlock(&t->mu);
    if (!match) close(fd);
}

static void on_closed(shm_t *t, shm_conn *c) {
    unmap_all(c); /* the owner is gone: nothing of it stays mapped here */
    pthread_mutex_lock(&t->mu);
    int was = c->state;
    close(c->in_fd);
    c->in_fd = -1;
    c->state = 3;
    pthread_mutex_unlock(&t->mu);
    if (was == 2) {
        pthread_mutex_lock(&c->out_mu);
        if (c->out_fd >= 0) shutdown(c->out_fd, SHUT_RDWR);
        pthread_mutex_unlock(&c->out_mu);
        pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, 0, c->peer, 0, -ECONNRESET, 0, "shm: peer %llu disconnected",
                      (unsigned long long)c->peer);
    }
}

static void on_message(shm_t *t, shm_conn *c) {
    shm_hdr h;
    static __thread shm_imm buf[IMM_PER_MSG];
    int fd[SHM_MAX_SEGS];
    ssize_t got = recv_msg(c->in_fd, &h, buf, sizeof buf, fd, -1);
    if (got == -EAGAIN) return;
    if (got < 0) {
        on_closed(t, c);
        return;
    }
    char why[PDKV_REASON_MAX] = "";
    int rc = 0;
    switch (h.type) {
    case SHM_MAP:
        if (t->fault_fail_maps) { /* only the listener thread reads or writes it */
            t->fault_fail_maps--;
            rc = pdkv_seterr(why, sizeof why, -ENOMEM, "mapping %llu granted bytes: %s (fault injection)",
                             (unsigned long long)h.len, strerror(ENOMEM));
            break;
        }
        rc = (size_t)got == h.n * sizeof(shm_piece)
                 ? do_map(c, &h, (const shm_piece *)buf, h.n, fd, why, sizeof why)
                 : pdkv_seterr(why, sizeof why, -EPROTO, "malformed grant message");
        break;
    case SHM_UNMAP:
    case SHM_UNMAP_KEY:
        rc = do_unmap(c, &h, h.type == SHM_UNMAP_KEY);
        if (rc) snprintf(why, sizeof why, "nothing mapped at key 0x%llx [%llu, +%llu)",
                         (unsigned long long)h.key, (unsigned long long)h.off, (unsigned long long)h.len);
        break;
    case SHM_IMM: {
        uint32_t cnt = (size_t)got / sizeof(shm_imm) < h.n ? (uint32_t)((size_t)got / sizeof(shm_imm)) : h.n;
        for (uint32_t i = 0; i < cnt; i++)
            pdkv_cq_pushf(&t->cq, PDKV_CQ_IMM, 0, c->peer, buf[i].len, 0, buf[i].imm, NULL);
        break;
    }
    case SHM_REFUSED: {
        char *r = (char *)buf;
        r[got < PDKV_REASON_MAX ? got : PDKV_REASON_MAX - 1] = 0;
        pthread_mutex_lock(&t->mu);
        t->refused_writes += h.n;
        pthread_mutex_unlock(&t->mu);
        pdkv_cq_pushf(&t->cq, PDKV_CQ_ERROR, 0, c->peer, 0, -EACCES, 0, "refused %u writes of peer %llu: %s",
                      h.n, (unsigned long long)c->peer, r);
        break;
    }
    default:
        rc = -EPROTO;
    }
    for (int i = 0; i < SHM_MAX_SEGS; i++) /* a mapping keeps the memory; no descriptor is kept */
        if (fd[i] >= 0) close(fd[i]);
    if (h.type == SHM_MAP || h.type == SHM_UNMAP || h.type == SHM_UNMAP_KEY) {
        shm_hdr a = {.type = SHM_ACK, .n = (uint32_t)rc};
        send_msg(c->in_fd, &a, why, strlen(why), -1);
    } else if (rc) {
        on_closed(t, c);
    }
}

static void *listener(void *arg) {
    shm_t *t = arg;
    struct pollfd pf[SHM_MAX_CONNS + 2];
    uint32_t who[SHM_MAX_CONNS + 2];
    while (__atomic_load_n(&t->running, __ATOMIC_ACQUIRE)) {
        int np = 0;
        pf[np++] = (struct pollfd){t->listen_fd, POLLIN, 0};
        pf[np++] = (struct pollfd){t->wake_fd, POLLIN, 0};
        pthread_mutex_lock(&t->mu);
        for (uint32_t i = 0; i < t->num_conns; i++)
            if (t->conns[i].in_fd >= 0) who[np] = i, pf[np++] = (struct pollfd){t->conns[i].in_fd, POLLIN, 0};
        pthread_mutex_unlock(&t->mu);
        if (poll(pf, (nfds_t)np, 200) <= 0) continue; /* 200 ms: new connections' fds are picked up */
        if (pf[1].revents) {
            uint64_t v;
            ssize_t r = read(t->wake_fd, &v, sizeof v);
            (void)r;
        }
        if (pf[0].revents & POLLIN) {
            int fd = accept4(t->listen_fd, NULL, NULL, SOCK_CLOEXEC);
            if (fd >= 0) on_hello(t, fd);
        }
        for (int k = 2; k < np; k++)
            if (pf[k].revents) on_message(t, &t->conns[who[k]]);
    }
    return NULL;
}

static int s_poll(pdkv_transport *bt, pdkv_completion *out, int max) { return pdkv_cq_poll(&((shm_t *)bt)->cq, out, max); }
static int s_event_fd(pdkv_transport *bt) { return ((shm_t *)bt)->cq.efd; }
static const char *s_last_error(pdkv_transport *bt) {
    (void)bt;
    return tls_err;
}

static void s_counters(pdkv_transport *bt, pdkv_transport_counters *out) {
    shm_t *t = (shm_t *)bt;
    pthread_mutex_lock(&t->mu);
    out->refused_writes = t->refused_writes;
    out->refused_conns = t->refused_conns;
    out->rx_threads = t->running ? 1 : 0;
    pthread_mutex_unlock(&t->mu);
    out->copied_writes = __atomic_load_n(&t->copied_writes, __ATOMIC_RELAXED);
    out->copied_bytes = __atomic_load_n(&t->copied_bytes, __ATOMIC_RELAXED);
    out->shared_writes = __atomic_load_n(&t->shared_writes, __ATOMIC_RELAXED);
}

static void s_destroy(pdkv_transport *bt) {
    shm_t *t = (shm_t *)bt;
    if (t->running) {
        __atomic_store_n(&t->running, 0, __ATOMIC_RELEASE);
        uint64_t one = 1;
        ssize_t r = write(t->wake_fd, &one, sizeof one);
        (void)r;
        pthread_join(t->thread, NULL);
    }
    for (uint32_t i = 0; i < t->num_conns; i++) {
        shm_conn *c = &t->conns[i];
        unmap_all(c);
        if (c->out_fd >= 0) close(c->out_fd);
        if (c->in_fd >= 0) close(c->in_fd);
        free(c->maps);
        free(c->aliases);
        pthread_mutex_destroy(&c->out_mu);
        pthread_mutex_destroy(&c->map_mu);
    }
    for (uint32_t i = 0; i < t->num_files; i++)
        for (uint32_t k = 0; k < t->files[i].nseg; k++) close(t->files[i].seg[k].fd);
    if (t->listen_fd >= 0) close(t->listen_fd);
    if (t->wake_fd >= 0) close(t->wake_fd);
    pdkv_regions_destroy(&t->regions);
    pdkv_cq_destroy(&t->cq);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static shm_conn *connected(shm_t *t, uint32_t id) {
    pthread_mutex_lock(&t->mu);
    shm_conn *c = conn_of(t, id);
    if (c && c->state != 2) c = NULL;
    pthread_mutex_unlock(&t->mu);
    return c;
}

static int s_share_pages(pdkv_transport *bt, uint32_t id, uint64_t lkey, uint64_t loff, uint64_t rkey,
                         uint64_t roff, uint64_t len) {
    shm_t *t = (shm_t *)bt;
    shm_conn *c = connected(t, id);
    if (!c) return serr(-ENOTCONN, "shm connection %u is not connected", id);
    pthread_mutex_lock(&c->map_mu);
    const shm_map *m = find_map(c, rkey, roff, len);
    int rc = m ? pdkv_shm_alias(c, m, lkey, loff, rkey, roff, len, tls_err, sizeof tls_err)
               : serr(-EACCES, "share_pages: region 0x%llx [%llu, +%llu) is not granted to us (not mapped)",
                      (unsigned long long)rkey, (unsigned long long)roff, (unsigned long long)len);
    pthread_mutex_unlock(&c->map_mu);
    return rc;
}

static int s_unshare_pages(pdkv_transport *bt, uint32_t id, uint64_t lkey, uint64_t loff, uint64_t len) {
    shm_t *t = (shm_t *)bt;
    pthread_mutex_lock(&t->mu);
    shm_conn *c = conn_of(t, id);
    pthread_mutex_unlock(&t->mu);
    if (!c) return serr(-ENOENT, "unknown shm connection %u", id);
    pthread_mutex_lock(&c->map_mu);
    pdkv_shm_unalias(c, lkey, loff, len);
    pthread_mutex_unlock(&c->map_mu);
    return 0;
}

static const pdkv_transport_ops shm_ops = {
    .name = "shm", .reg = s_reg, .grant = s_grant, .revoke = s_revoke, .grant_range = s_grant_range,
    .revoke_range = s_revoke_range, .dereg = s_dereg, .prepare = s_prepare, .complete = s_complete,
    .set_token = s_set_token, .disconnect = s_disconnect, .post = s_post, .poll = s_poll,
    .event_fd = s_event_fd, .last_error = s_last_error, .counters = s_counters, .destroy = s_destroy,
    .share_pages = s_share_pages, .unshare_pages = s_unshare_pages, .reg_source = s_reg_source,
};

static int listen_abstract(shm_t *t, char *err, size_t errlen) {
    uint64_t r = 0;
    int u = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (u >= 0) {
        ssize_t got = read(u, &r, sizeof r);
        (void)got;
        close(u);
    }
    snprintf(t->name + 1, sizeof t->name - 1, "pdkv-shm-%d-%016llx", (int)getpid(), (unsigned long long)r);
    struct sockaddr_un a;
    socklen_t alen = addr_of(t->name, &a);
    t->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (t->listen_fd < 0 || bind(t->listen_fd, (struct sockaddr *)&a, alen) < 0 || listen(t->listen_fd, 64) < 0)
        return snprintf(err, errlen, "shm: listening on @%s: %s", t->name + 1, strerror(errno)), -1;
    return 0;
}

pdkv_transport *pdkv_shm_create(uint64_t node_id, const pdkv_shm_opts *opts, char *err, size_t errlen) {
    shm_t *t = calloc(1, sizeof *t);
    if (!t) return snprintf(err, errlen, "out of memory"), NULL;
    t->base.ops = &shm_ops, t->base.node_id = node_id;
    t->listen_fd = t->wake_fd = -1;
    snprintf(t->dir, sizeof t->dir, "%s", opts && opts->dir && *opts->dir ? opts->dir : "/dev/shm");
    pdkv_shm_host_id(t->host, sizeof t->host);
    if (opts && opts->fault_host_id && *opts->fault_host_id)
        snprintf(t->host, sizeof t->host, "%s", opts->fault_host_id);
    t->fault_fail_maps = opts ? opts->fault_fail_maps : 0;
    t->lazy_alloc = opts ? opts->lazy_alloc : 0;
    pthread_mutex_init(&t->mu, NULL);
    for (uint32_t i = 0; i < SHM_MAX_CONNS; i++) {
        pthread_mutex_init(&t->conns[i].out_mu, NULL);
        pthread_mutex_init(&t->conns[i].map_mu, NULL);
        t->conns[i].out_fd = t->conns[i].in_fd = -1;
        t->conns[i].owner = t;
    }
    t->num_conns = 0;
    pdkv_regions_init(&t->regions);
    int rc = pdkv_cq_init(&t->cq);
    if (rc < 0) snprintf(err, errlen, "completion queue: %s", strerror(-rc));
    struct stat st;
    if (!rc && (stat(t->dir, &st) < 0 || !S_ISDIR(st.st_mode)))
        rc = -1, snprintf(err, errlen, "shm: %s is not a directory (the shared memory the KV lives in)", t->dir);
    if (!rc && (t->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
        rc = -1, snprintf(err, errlen, "shm: eventfd: %s", strerror(errno));
    if (!rc) rc = listen_abstract(t, err, errlen);
    if (!rc) {
        t->running = 1;
        if (pthread_create(&t->thread, NULL, listener, t)) t->running = 0, rc = -1, snprintf(err, errlen, "shm: thread");
    }
    if (rc) {
        /* conns' mutexes destroyed by s_destroy over every slot */
        t->num_conns = SHM_MAX_CONNS;
        s_destroy(&t->base);
        return NULL;
    }
    return &t->base;
}
