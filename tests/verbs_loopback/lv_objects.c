/* Loopback verbs device: devices, contexts, queries, PDs, MRs, CQs, completion channels, SRQs.
 * See lv_internal.h for the model. Exported names carry the real library's symbol versions
 * (libibverbs.map). */
#include "lv_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_reg_mr_iova
#undef ibv_reg_dmabuf_mr
#undef ibv_get_device_list

pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t g_cond = PTHREAD_COND_INITIALIZER;

static struct ibv_device g_devices[LV_MAX_DEVICES];
static int g_num_devices = -1;
static uint64_t g_counts[LV_MAX_DEVICES][4]; /* tx writes, tx bytes, rx writes, rx bytes */
static struct lv_mr *g_mrs;
static uint32_t g_next_key = 0x1000;
static uint32_t g_next_handle = 1;

long lv_fault(const char *name)
{
    static char spec[256] = "";
    static int read_env;
    if (!read_env) {
        const char *env = getenv("PDKV_LOOPBACK_FAULTS");
        snprintf(spec, sizeof spec, ",%s,", env ? env : "");
        read_env = 1;
    }
    char key[64];
    snprintf(key, sizeof key, ",%s", name);
    const char *p = strstr(spec, key);
    if (!p)
        return 0;
    p += strlen(key);
    return *p == '=' ? atol(p + 1) : *p == ',' ? 1 : 0;
}

/* PDKV_LOOPBACK_NICS="a,b" names the devices (default one device "lo_verbs0"). */
static void init_devices(void)
{
    if (g_num_devices >= 0)
        return;
    const char *env = getenv("PDKV_LOOPBACK_NICS");
    char buf[LV_MAX_DEVICES * 65]; /* up to 16 names of up to 63 bytes */
    snprintf(buf, sizeof buf, "%s", env && *env ? env : "lo_verbs0");
    g_num_devices = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && g_num_devices < LV_MAX_DEVICES;
         tok = strtok_r(NULL, ",", &save)) {
        struct ibv_device *d = &g_devices[g_num_devices++];
        memset(d, 0, sizeof *d);
        d->node_type = IBV_NODE_CA;
        d->transport_type = IBV_TRANSPORT_IB;
        snprintf(d->name, sizeof d->name, "%s", tok);
        snprintf(d->dev_name, sizeof d->dev_name, "uverbs%d", g_num_devices - 1);
    }
}

void lv_count(struct ibv_device *dev, int rx, uint64_t bytes)
{
    long i = dev - g_devices;
    if (i >= 0 && i < LV_MAX_DEVICES) {
        g_counts[i][rx ? 2 : 0]++;
        g_counts[i][rx ? 3 : 1] += bytes;
    }
}

/* Test-only export (not a libibverbs symbol): 0 and the four counts, -1 for an unknown name. */
int pdkv_loopback_counters(const char *name, uint64_t out[4])
{
    pthread_mutex_lock(&g_mu);
    init_devices();
    int rc = -1;
    for (int i = 0; i < g_num_devices; i++)
        if (!strcmp(g_devices[i].name, name)) {
            memcpy(out, g_counts[i], sizeof g_counts[i]);
            rc = 0;
        }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* Test-only export: 0 and the device's live MRs and QPs, -1 for an unknown name. */
int pdkv_loopback_objects(const char *name, uint64_t out[2])
{
    pthread_mutex_lock(&g_mu);
    init_devices();
    int rc = -1;
    for (int i = 0; i < g_num_devices; i++)
        if (!strcmp(g_devices[i].name, name)) {
            out[0] = 0;
            for (struct lv_mr *m = g_mrs; m; m = m->next)
                out[0] += m->mr.context->device == &g_devices[i];
            out[1] = (uint64_t)lv_num_qps(&g_devices[i]);
            rc = 0;
        }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

struct ibv_device **ibv_get_device_list(int *num)
{
    pthread_mutex_lock(&g_mu);
    init_devices();
    struct ibv_device **list = calloc(g_num_devices + 1, sizeof *list);
    for (int i = 0; list && i < g_num_devices; i++)
        list[i] = &g_devices[i];
    if (num)
        *num = list ? g_num_devices : 0;
    pthread_mutex_unlock(&g_mu);
    if (!list)
        errno = ENOMEM;
    return list;
}

void ibv_free_device_list(struct ibv_device **list) { free(list); }
const char *ibv_get_device_name(struct ibv_device *device) { return device->name; }

struct ibv_context *ibv_open_device(struct ibv_device *device)
{
    struct lv_context *c = calloc(1, sizeof *c);
    if (!c || pipe2(c->async_pipe, O_CLOEXEC) || lv_listener_acquire()) {
        free(c);
        errno = EIO;
        return NULL;
    }
    c->ctx.device = device;
    c->ctx.cmd_fd = -1;
    c->ctx.async_fd = c->async_pipe[0];
    c->ctx.num_comp_vectors = 1;
    c->ctx.abi_compat = NULL; /* not an extended context: verbs.h falls back to plain symbols */
    pthread_mutex_init(&c->ctx.mutex, NULL);
    c->ctx.ops.post_send = lv_post_send;
    c->ctx.ops.post_recv = lv_post_recv;
    c->ctx.ops.post_srq_recv = lv_post_srq_recv;
    extern int lv_poll_cq(struct ibv_cq *, int, struct ibv_wc *);
    extern int lv_req_notify_cq(struct ibv_cq *, int);
    c->ctx.ops.poll_cq = lv_poll_cq;
    c->ctx.ops.req_notify_cq = lv_req_notify_cq;
    return &c->ctx;
}

int ibv_close_device(struct ibv_context *ctx)
{
    struct lv_context *c = (struct lv_context *)ctx;
    close(c->async_pipe[0]);
    close(c->async_pipe[1]);
    free(c);
    lv_listener_release();
    return 0;
}

int ibv_query_device(struct ibv_context *ctx, struct ibv_device_attr *a)
{
    memset(a, 0, sizeof *a);
    snprintf(a->fw_ver, sizeof a->fw_ver, "pdkv-loopback");
    a->max_mr_size = UINT64_MAX;
    a->max_qp = 1 << 16;
    a->max_qp_wr = 16384;
    a->max_sge = 16;
    a->max_cq = 1 << 16;
    a->max_cqe = 1 << 22;
    a->max_mr = 1 << 20;
    a->max_pd = 1 << 16;
    a->max_srq = 1 << 16;
    a->max_srq_wr = 16384;
    a->max_srq_sge = 1;
    a->phys_port_cnt = 1;
    return 0;
}

/* The caller (verbs.h's inline wrapper) zeroed the whole struct; fill the compat fields only. */
int ibv_query_port(struct ibv_context *ctx, uint8_t port, struct _compat_ibv_port_attr *attr)
{
    struct ibv_port_attr *a = (struct ibv_port_attr *)attr;
    if (port != 1)
        return EINVAL;
    /* FAULT INJECTION: port_down=K reports the K-th device's port (1-based) DOWN, link disabled */
    long down = lv_fault("port_down");
    int is_down = down > 0 && down <= LV_MAX_DEVICES && ctx->device == &g_devices[down - 1];
    a->state = is_down ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
    a->max_mtu = IBV_MTU_4096;
    a->active_mtu = IBV_MTU_4096;
    a->gid_tbl_len = 1;
    a->max_msg_sz = 1u << 31;
    a->pkey_tbl_len = 1;
    a->phys_state = is_down ? 3 : 5; /* Disabled : LinkUp */
    a->active_width = 2;  /* 4X */
    a->active_speed = 32; /* EDR: 4X EDR = 100 Gb/s */
    a->link_layer = lv_link_is_ib() ? IBV_LINK_LAYER_INFINIBAND : IBV_LINK_LAYER_ETHERNET;
    a->lid = lv_local_lid();
    return 0;
}

int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid)
{
    if (port != 1 || index != 0)
        return -1;
    lv_local_gid(gid);
    return 0;
}

int _ibv_query_gid_ex(struct ibv_context *ctx, uint32_t port, uint32_t index,
                      struct ibv_gid_entry *e, uint32_t flags, size_t size)
{
    if (port != 1 || index != 0 || size < sizeof *e)
        return index != 0 ? ENODATA : EINVAL;
    memset(e, 0, sizeof *e);
    lv_local_gid(&e->gid);
    e->port_num = 1;
    e->gid_type = lv_link_is_ib() ? IBV_GID_TYPE_IB : IBV_GID_TYPE_ROCE_V2;
    e->ndev_ifindex = 1;
    return 0;
}

struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx)
{
    struct lv_pd *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->pd.context = ctx;
    pthread_mutex_lock(&g_mu);
    p->pd.handle = g_next_handle++;
    pthread_mutex_unlock(&g_mu);
    return &p->pd;
}

int ibv_dealloc_pd(struct ibv_pd *pd)
{
    free(pd);
    return 0;
}

/* no_peermem: an address this process has not mapped is a device pointer nobody can resolve. */
static int unmapped(const void *addr, size_t len)
{
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)addr & ~(uintptr_t)(page - 1);
    unsigned char v;
    (void)len;
    return mincore((void *)a, (size_t)page, &v) != 0; /* ENOMEM: not mapped here */
}

struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova,
                                unsigned int access)
{
    if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
        !(access & IBV_ACCESS_LOCAL_WRITE)) {
        errno = EINVAL; /* the spec requires LOCAL_WRITE with REMOTE_WRITE */
        return NULL;
    }
    /* every entry point registers through here (verbs.h turns a non-constant access into
     * ibv_reg_mr_iova2); a dma-buf's own mapping is always mapped */
    if (lv_fault("no_peermem") && unmapped(addr, len)) {
        errno = EFAULT;
        return NULL;
    }
    long enomem = lv_fault("reg_enomem_len"); /* FAULT INJECTION: the pages cannot be pinned */
    if (enomem > 0 && (size_t)enomem == len) {
        errno = ENOMEM;
        return NULL;
    }
    struct lv_mr *m = calloc(1, sizeof *m);
    if (!m) {
        errno = ENOMEM;
        return NULL;
    }
    m->mr.context = pd->context;
    m->mr.pd = pd;
    m->mr.addr = addr;
    m->mr.length = len;
    m->iova = iova;
    m->access = (int)access;
    pthread_mutex_lock(&g_mu);
    m->mr.handle = g_next_handle++;
    m->mr.lkey = g_next_key++;
    m->mr.rkey = (g_next_key++) * 2654435761u; /* scattered, like hardware keys */
    m->next = g_mrs;
    g_mrs = m;
    pthread_mutex_unlock(&g_mu);
    return &m->mr;
}

/* Test stand-in for a GPU dma-buf: the fd's pages, mapped by the provider (lv_internal.h). */
struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length, uint64_t iova,
                                 int fd, int access)
{
    if (lv_fault("no_dmabuf")) {
        errno = EOPNOTSUPP;
        return NULL;
    }
    long page = sysconf(_SC_PAGESIZE);
    uint64_t base = offset & ~(uint64_t)(page - 1), skip = offset - base;
    if (!length) {
        errno = EINVAL;
        return NULL;
    }
    void *map = mmap(NULL, length + skip, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)base);
    if (map == MAP_FAILED)
        return NULL; /* errno from mmap: EBADF, ENODEV (not mappable), EACCES ... */
    struct ibv_mr *mr = ibv_reg_mr_iova2(pd, (char *)map + skip, length, iova, (unsigned)access);
    if (!mr) {
        int e = errno;
        munmap(map, length + skip);
        errno = e;
        return NULL;
    }
    struct lv_mr *m = (struct lv_mr *)mr;
    m->map = map;
    m->map_len = length + skip;
    return mr;
}

struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
    return ibv_reg_mr_iova2(pd, addr, len, (uintptr_t)addr, (unsigned)access);
}

struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova, int access)
{
    return ibv_reg_mr_iova2(pd, addr, len, iova, (unsigned)access);
}

/* NOTE: waits until no payload copy into or out of the MR is in progress, then unlinks it. */
int ibv_dereg_mr(struct ibv_mr *mr)
{
    struct lv_mr *m = (struct lv_mr *)mr;
    pthread_mutex_lock(&g_mu);
    /* FAULT INJECTION: dereg_busy_nic / _times / _len / _skip (lv_internal.h) */
    static long busy_left = -1, skip_left = -1;
    long nic = lv_fault("dereg_busy_nic"), len = lv_fault("dereg_busy_len");
    if (busy_left < 0) {
        busy_left = lv_fault("dereg_busy_times") > 0 ? lv_fault("dereg_busy_times") : 1;
        skip_left = lv_fault("dereg_busy_skip") > 0 ? lv_fault("dereg_busy_skip") : 0;
    }
    int on_nic = nic == -1 || (nic > 0 && nic <= LV_MAX_DEVICES && mr->context->device == &g_devices[nic - 1]);
    int match = on_nic && busy_left > 0 && (!len || (size_t)len == mr->length);
    if (match && skip_left > 0) {
        skip_left--;
        match = 0;
    }
    if (match) {
        busy_left--;
        pthread_mutex_unlock(&g_mu);
        errno = EBUSY;
        return EBUSY;
    }
    while (m->busy)
        pthread_cond_wait(&g_cond, &g_mu);
    for (struct lv_mr **p = &g_mrs; *p; p = &(*p)->next)
        if (*p == m) {
            *p = m->next;
            break;
        }
    pthread_mutex_unlock(&g_mu);
    if (m->map)
        munmap(m->map, m->map_len);
    free(m);
    return 0;
}

struct lv_mr *lv_find_mr_rkey(uint32_t rkey)
{
    for (struct lv_mr *m = g_mrs; m; m = m->next)
        if (m->mr.rkey == rkey)
            return m;
    return NULL;
}

struct lv_mr *lv_find_mr_lkey(uint32_t lkey)
{
    for (struct lv_mr *m = g_mrs; m; m = m->next)
        if (m->mr.lkey == lkey)
            return m;
    return NULL;
}
