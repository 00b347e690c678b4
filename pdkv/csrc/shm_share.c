/* Memory a same-host peer can map (shm transport, see shm_internal.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "shm_internal.h"

uint64_t pdkv_shm_page(void) {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (uint64_t)p : 4096;
}

void pdkv_shm_host_id(char *out, size_t n) {
    snprintf(out, n, "unknown");
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f) return;
    if (fgets(out, (int)n, f)) out[strcspn(out, "\n")] = 0;
    fclose(f);
}

typedef struct vma { uint64_t start, end, pgoff; char perms[5]; char path[256]; } vma;

/* The mappings of this process overlapping [a0, a1), in address order; returns how many (<= max). */
static int vmas_of(uint64_t a0, uint64_t a1, vma *out, int max) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return -errno;
    char line[512];
    int k = 0;
    while (k < max && fgets(line, sizeof line, f)) {
        vma v = {0};
        unsigned long long s, e, off;
        int pos = 0;
        if (sscanf(line, "%llx-%llx %4s %llx %*s %*s%n", &s, &e, v.perms, &off, &pos) < 4) continue;
        if (e <= a0 || s >= a1) continue;
        const char *p = line + pos;
        while (*p == ' ') p++;
        snprintf(v.path, sizeof v.path, "%s", p);
        v.path[strcspn(v.path, "\n")] = 0;
        v.start = s, v.end = e, v.pgoff = off;
        out[k++] = v;
    }
    fclose(f);
    return k;
}

static int all_zero(const uint8_t *p, uint64_t n) {
    const uint64_t *q = (const uint64_t *)p;
    for (uint64_t i = 0; i < n / 8; i++)
        if (q[i]) return 0;
    return 1;
}

/* Move the private anonymous pages [a0, a1) onto a new unnamed file in dir, in place. */
static int move_anon(const char *dir, int lazy, uint64_t a0, uint64_t a1, shm_seg *sg, char *why, size_t n) {
    const uint64_t pg = pdkv_shm_page(), size = a1 - a0;
    struct statvfs sv;
    if (statvfs(dir, &sv) < 0)
        return pdkv_seterr(why, n, -errno, "shm: %s: %s", dir, strerror(errno));
    uint64_t avail = (uint64_t)sv.f_bavail * sv.f_frsize;
    if (avail < size)
        return pdkv_seterr(why, n, -ENOSPC, "shm: %s has %llu bytes free, registering this region needs "
                           "%llu (enlarge it, e.g. docker --shm-size, or use messenger.transport tcp)",
                           dir, (unsigned long long)avail, (unsigned long long)size);
    int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600); /* unnamed: gone with its last user */
    if (fd < 0) return pdkv_seterr(why, n, -errno, "shm: unnamed file in %s: %s", dir, strerror(errno));
    /* every page now: a full /dev/shm is this error at start, never a SIGBUS while serving
     * (lazy: the caller chose pages allocated as they are first touched, and that risk) */
    int frc = ftruncate(fd, (off_t)size) < 0 ? errno : lazy ? 0 : posix_fallocate(fd, 0, (off_t)size);
    if (frc) {
        close(fd);
        return pdkv_seterr(why, n, -frc, "shm: %s: allocating %llu bytes (%llu were free): %s", dir,
                           (unsigned long long)size, (unsigned long long)avail, strerror(frc));
    }
    uint8_t *tmp = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (tmp == MAP_FAILED) {
        int e = errno;
        close(fd);
        return pdkv_seterr(why, n, -e, "shm: mapping the new file: %s", strerror(e));
    }
    for (uint64_t o = 0; o < size; o += pg) /* the file reads zero: copy only what is not */
        if (!all_zero((const uint8_t *)(a0 + o), pg)) memcpy(tmp + o, (const void *)(a0 + o), pg);
    munmap(tmp, size);
    if (mmap((void *)a0, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        int e = errno;
        close(fd);
        return pdkv_seterr(why, n, -e, "shm: moving [0x%llx, +%llu) onto shared memory: %s",
                           (unsigned long long)a0, (unsigned long long)size, strerror(e));
    }
    *sg = (shm_seg){a0, a1, 0, fd};
    return 0;
}

static int anon_rw(const vma *v) {
    return v->perms[3] == 'p' && v->perms[0] == 'r' && v->perms[1] == 'w' &&
           (!v->path[0] || !strcmp(v->path, "[heap]"));
}

int pdkv_shm_share(const char *dir, int lazy, void *addr, uint64_t len, shm_file *f, char *why, size_t n) {
    const uint64_t pg = pdkv_shm_page();
    uint64_t a0 = (uint64_t)addr & ~(pg - 1), a1 = ((uint64_t)addr + len + pg - 1) & ~(pg - 1);
    vma v[64];
    int k = vmas_of(a0, a1, v, 64), rc = 0;
    if (k <= 0 || v[0].start > a0 || v[k - 1].end < a1)
        return pdkv_seterr(why, n, -EFAULT, "shm: [%p, +%llu) is not mapped memory", addr,
                           (unsigned long long)len);
    for (int i = 1; i < k; i++)
        if (v[i].start != v[i - 1].end)
            return pdkv_seterr(why, n, -EFAULT, "shm: [%p, +%llu) has a hole", addr, (unsigned long long)len);
    for (int i = 0; i < k; i++)
        if (v[i].perms[3] != 's' && !anon_rw(&v[i]))
            return pdkv_seterr(why, n, -EINVAL, "shm: [%p, +%llu) lies in a mapping the shm transport "
                               "cannot share (%s %s): register private anonymous or shared memory",
                               addr, (unsigned long long)len, v[i].perms, v[i].path[0] ? v[i].path : "anon");
    f->addr = (uint64_t)addr, f->len = len;
    f->nseg = 0, f->source = 0;
    for (int i = 0; i < k && !rc;) {
        uint64_t s0 = v[i].start > a0 ? v[i].start : a0;
        if (f->nseg == SHM_MAX_SEGS) {
            rc = pdkv_seterr(why, n, -E2BIG, "shm: [%p, +%llu) spans more than %d mappings", addr,
                             (unsigned long long)len, SHM_MAX_SEGS);
            break;
        }
        shm_seg *sg = &f->seg[f->nseg];
        if (v[i].perms[3] == 's') { /* a neighbour's moved page, or a TP rank's file: reopen it */
            uint64_t s1 = v[i].end < a1 ? v[i].end : a1;
            char p[64];
            snprintf(p, sizeof p, "/proc/self/map_files/%llx-%llx", (unsigned long long)v[i].start,
                     (unsigned long long)v[i].end);
            int fd = open(p, O_RDWR | O_CLOEXEC);
            if (fd < 0) {
                rc = pdkv_seterr(why, n, -errno, "shm: cannot reopen the shared mapping of %s at %p (%s; "
                                 "needs CAP_CHECKPOINT_RESTORE): use messenger.transport tcp", v[i].path,
                                 addr, strerror(errno));
                break;
            }
            *sg = (shm_seg){s0, s1, v[i].pgoff + (s0 - v[i].start), fd};
            i++;
        } else { /* a run of private anonymous mappings */
            int j = i;
            while (j < k && anon_rw(&v[j])) j++;
            uint64_t s1 = v[j - 1].end < a1 ? v[j - 1].end : a1;
            rc = move_anon(dir, lazy, s0, s1, sg, why, n);
            i = j;
        }
        if (!rc) f->nseg++;
    }
    if (rc)
        for (uint32_t i = 0; i < f->nseg; i++) close(f->seg[i].fd);
    return rc;
}
