/* pdkv verbs transport: opening the NIC and creating the PD, CQ and SRQ (kept full of receives).
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int vb_set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Zero-length receives: WRITE_WITH_IMM consumes one and places no data into it. */
int vb_post_recvs(struct ibv_srq *srq, int n)
{
    struct ibv_recv_wr wrs[64], *bad;
    while (n > 0) {
        int k = n < 64 ? n : 64;
        for (int i = 0; i < k; i++) {
            memset(&wrs[i], 0, sizeof wrs[i]);
            wrs[i].wr_id = VB_RECV_ID;
            wrs[i].next = i + 1 < k ? &wrs[i + 1] : NULL;
        }
        if (ibv_post_srq_recv(srq, wrs, &bad))
            return -1;
        n -= k;
    }
    return 0;
}

static int is_ipv4_mapped(const union ibv_gid *g)
{
    static const uint8_t p[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return !memcmp(g->raw, p, sizeof p);
}

/* RoCE: prefer a RoCE v2 GID with an IPv4 address (routable, what NCCL/NIXL pick), then any
 * RoCE v2 GID, then index 0. IB: index 0 (the port GID); routing uses the LID. */
static int pick_gid(vb_transport *t, int wanted, int tbl_len)
{
    if (wanted >= 0) {
        if (ibv_query_gid(t->ctx, t->port_num, wanted, &t->gid)) {
            vb_fail(t, "verbs: GID index %d does not exist on port %u", wanted, t->port_num);
            return -1;
        }
        t->gid_index = wanted;
        return 0;
    }
    int best = -1, best_score = 0;
    for (int i = 0; t->link_layer == IBV_LINK_LAYER_ETHERNET && i < tbl_len; i++) {
        struct ibv_gid_entry e;
        if (ibv_query_gid_ex(t->ctx, t->port_num, (uint32_t)i, &e, 0) ||
            e.gid_type != IBV_GID_TYPE_ROCE_V2)
            continue;
        int score = is_ipv4_mapped(&e.gid) ? 2 : 1;
        if (score > best_score)
            best = i, best_score = score;
    }
    t->gid_index = best >= 0 ? best : 0;
    if (ibv_query_gid(t->ctx, t->port_num, t->gid_index, &t->gid)) {
        vb_fail(t, "verbs: cannot read GID %d of port %u", t->gid_index, t->port_num);
        return -1;
    }
    return 0;
}

static struct ibv_context *open_nic(vb_transport *t, const char *name)
{
    int num = 0;
    errno = 0;
    struct ibv_device **list = ibv_get_device_list(&num);
    if (!list) {
        /* A kernel without RDMA answers NULL + ENOSYS, not an empty list. */
        if (errno == ENOSYS)
            vb_fail(t, "verbs: no RDMA device: this kernel has no RDMA support "
                       "(ibv_get_device_list: ENOSYS); use the tcp transport");
        else
            vb_fail(t, "verbs: no RDMA device: ibv_get_device_list failed: %s",
                    strerror(errno ? errno : EIO));
        return NULL;
    }
    struct ibv_context *ctx = NULL;
    char names[160] = "";
    int found = 0;
    for (int i = 0; i < num; i++) {
        const char *n = ibv_get_device_name(list[i]);
        if (!strcmp(n, name) && !found++)
            ctx = ibv_open_device(list[i]);
        size_t used = strlen(names);
        snprintf(names + used, sizeof names - used, "%s%s", i ? ", " : "", n);
    }
    if (!num)
        vb_fail(t, "verbs: no RDMA device found (the device list is empty)");
    else if (!ctx)
        vb_fail(t, "verbs: NIC '%s' %s; available: %s", name,
                found ? "could not be opened" : "not found", names);
    ibv_free_device_list(list);
    return ctx;
}

int vb_open_device(vb_transport *t, const pdkv_verbs_opts *o)
{
    struct ibv_device_attr dev;
    struct ibv_port_attr port;
    if (!(t->ctx = open_nic(t, o->nics[0])))
        return -1;
    const char *nic = ibv_get_device_name(t->ctx->device);
    if (ibv_query_device(t->ctx, &dev) || ibv_query_port(t->ctx, t->port_num, &port)) {
        vb_fail(t, "verbs: cannot query NIC %s port %u", nic, t->port_num);
        return -1;
    }
    if (port.state != IBV_PORT_ACTIVE) {
        vb_fail(t, "verbs: port %u of NIC %s is not active (state %d)", t->port_num, nic,
                (int)port.state);
        return -1;
    }
    t->link_layer = port.link_layer;
    t->mtu = (uint8_t)port.active_mtu;
    t->lid = port.lid;
    if (t->link_layer != IBV_LINK_LAYER_ETHERNET && !t->lid) {
        vb_fail(t, "verbs: InfiniBand port %u of NIC %s has no LID (subnet manager?)",
                t->port_num, nic);
        return -1;
    }
    if (pick_gid(t, o->gid_index, port.gid_tbl_len))
        return -1;
    t->sq_depth = VB_SQ_DEPTH < dev.max_qp_wr ? VB_SQ_DEPTH : (uint32_t)dev.max_qp_wr;
    t->srq_depth = VB_SRQ_DEPTH < dev.max_srq_wr ? VB_SRQ_DEPTH : (uint32_t)dev.max_srq_wr;
    /* room for one connection's QPs and one SRQ; vb_prepare grows it with the QPs it adds */
    t->max_cqe = (uint32_t)dev.max_cqe;
    uint64_t want = (uint64_t)t->sq_depth * t->qps_per_peer + t->srq_depth;
    int cqe = (int)(want < t->max_cqe ? want : t->max_cqe);
    t->cq_size = (uint32_t)cqe;
    struct ibv_srq_init_attr sa = {.attr = {.max_wr = t->srq_depth, .max_sge = 1}};
    if (!(t->pd = ibv_alloc_pd(t->ctx)) || !(t->channel = ibv_create_comp_channel(t->ctx)) ||
        !(t->cq = ibv_create_cq(t->ctx, cqe, t, t->channel, 0)) ||
        !(t->srq = ibv_create_srq(t->pd, &sa)) || vb_post_recvs(t->srq, (int)t->srq_depth)) {
        vb_fail(t, "verbs: cannot create PD/CQ/SRQ on NIC %s: %s", nic, strerror(errno));
        return -1;
    }
    return 0;
}

#endif /* PDKV_HAVE_VERBS */
