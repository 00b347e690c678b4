/* Loopback verbs device: the rest of the libibverbs ABI that rdma-core's pyverbs and librdmacm
 * bind when they load. Both are linked with BIND_NOW, so every symbol they name must exist or
 * `import pyverbs.device` fails before a verb is called. The queries pdkv's probe makes (device
 * GUID and index, P_Key table, GID table and GID types, fork support, a QP's attributes) answer
 * as a one-port device would; the verbs this device does not model (address handles, multicast,
 * SRQ changes, re-registration, importing objects, ECE) fail with EOPNOTSUPP, as a provider
 * without them does. */
#include "lv_internal.h"

#include <errno.h>
#include <string.h>
#include <sys/types.h>

__be64 ibv_get_device_guid(struct ibv_device *device)
{
    /* a stable GUID per device name, like a NIC's node GUID */
    uint64_t h = 1469598103934665603ull;
    for (const char *p = device->name; *p; p++)
        h = (h ^ (uint8_t)*p) * 1099511628211ull;
    return htobe64(h);
}

int ibv_get_device_index(struct ibv_device *device)
{
    struct ibv_device **list = ibv_get_device_list(NULL);
    int index = -1;
    for (int i = 0; list && list[i]; i++)
        if (list[i] == device)
            index = i;
    ibv_free_device_list(list);
    return index;
}

int ibv_query_pkey(struct ibv_context *context, uint8_t port_num, int index, __be16 *pkey)
{
    if (port_num != 1 || index != 0)
        return EINVAL;
    *pkey = htobe16(0xffff); /* the default full-membership partition */
    return 0;
}

int ibv_get_pkey_index(struct ibv_context *context, uint8_t port_num, __be16 pkey)
{
    return port_num == 1 && be16toh(pkey) == 0xffff ? 0 : -1;
}

ssize_t _ibv_query_gid_table(struct ibv_context *context, struct ibv_gid_entry *entries,
                             size_t max_entries, uint32_t flags, size_t entry_size)
{
    if (max_entries < 1)
        return -EINVAL;
    int rc = _ibv_query_gid_ex(context, 1, 0, entries, flags, entry_size);
    return rc ? -rc : 1;
}

/* rdma-core's private helper (driver.h, not installed): 0 = IB / RoCE v1, 1 = RoCE v2. */
int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num, unsigned int index,
                       int *type)
{
    if (port_num != 1 || index != 0)
        return -1;
    *type = lv_link_is_ib() ? 0 : 1;
    return 0;
}

int ibv_fork_init(void) { return 0; }
enum ibv_fork_status ibv_is_fork_initialized(void) { return IBV_FORK_UNNEEDED; }

int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                 struct ibv_qp_init_attr *init_attr)
{
    struct lv_qp *q = (struct lv_qp *)qp;
    memset(attr, 0, sizeof *attr);
    memset(init_attr, 0, sizeof *init_attr);
    pthread_mutex_lock(&g_mu);
    attr->qp_state = attr->cur_qp_state = qp->state;
    attr->qp_access_flags = (unsigned)q->access;
    attr->dest_qp_num = q->dest_qpn;
    attr->port_num = 1;
    attr->path_mtu = IBV_MTU_4096;
    attr->cap.max_send_wr = init_attr->cap.max_send_wr = (uint32_t)q->max_send_wr;
    attr->cap.max_recv_wr = init_attr->cap.max_recv_wr = (uint32_t)q->max_recv_wr;
    attr->cap.max_send_sge = init_attr->cap.max_send_sge = 16;
    attr->cap.max_recv_sge = init_attr->cap.max_recv_sge = 1;
    pthread_mutex_unlock(&g_mu);
    init_attr->qp_context = qp->qp_context;
    init_attr->send_cq = qp->send_cq;
    init_attr->recv_cq = qp->recv_cq;
    init_attr->srq = qp->srq;
    init_attr->qp_type = qp->qp_type;
    init_attr->sq_sig_all = q->sq_sig_all;
    return 0;
}

int ibv_query_qp_data_in_order(struct ibv_qp *qp, enum ibv_wr_opcode op, uint32_t flags)
{
    return 0; /* no in-order guarantee is promised */
}

/* ---- not modelled: fail as a provider without the verb does ---- */

#define UNSUPPORTED_INT { return EOPNOTSUPP; }
#define UNSUPPORTED_PTR { errno = EOPNOTSUPP; return NULL; }

struct ibv_ah *ibv_create_ah(struct ibv_pd *pd, struct ibv_ah_attr *attr) UNSUPPORTED_PTR
struct ibv_ah *ibv_create_ah_from_wc(struct ibv_pd *pd, struct ibv_wc *wc, struct ibv_grh *grh,
                                     uint8_t port_num) UNSUPPORTED_PTR
int ibv_destroy_ah(struct ibv_ah *ah) UNSUPPORTED_INT
int ibv_attach_mcast(struct ibv_qp *qp, const union ibv_gid *gid, uint16_t lid) UNSUPPORTED_INT
int ibv_detach_mcast(struct ibv_qp *qp, const union ibv_gid *gid, uint16_t lid) UNSUPPORTED_INT
int ibv_query_srq(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr) UNSUPPORTED_INT
int ibv_modify_srq(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr, int mask) UNSUPPORTED_INT
int ibv_rereg_mr(struct ibv_mr *mr, int flags, struct ibv_pd *pd, void *addr, size_t length,
                 int access) UNSUPPORTED_INT
int ibv_set_ece(struct ibv_qp *qp, struct ibv_ece *ece) UNSUPPORTED_INT
int ibv_query_ece(struct ibv_qp *qp, struct ibv_ece *ece) UNSUPPORTED_INT
struct ibv_qp_ex *ibv_qp_to_qp_ex(struct ibv_qp *qp) UNSUPPORTED_PTR
struct ibv_context *ibv_import_device(int cmd_fd) UNSUPPORTED_PTR
struct ibv_pd *ibv_import_pd(struct ibv_context *context, uint32_t pd_handle) UNSUPPORTED_PTR
struct ibv_mr *ibv_import_mr(struct ibv_pd *pd, uint32_t mr_handle) UNSUPPORTED_PTR
struct ibv_dm *ibv_import_dm(struct ibv_context *context, uint32_t dm_handle) UNSUPPORTED_PTR
void ibv_unimport_pd(struct ibv_pd *pd) {}
void ibv_unimport_mr(struct ibv_mr *mr) {}
void ibv_unimport_dm(struct ibv_dm *dm) {}

/* librdmacm's kernel-ABI and sysfs helpers (driver.h / sysfs.h, not installed). librdmacm only
 * calls them from rdma_* functions, which nothing run on this device uses. */
void ibv_copy_ah_attr_from_kern(void *dst, const void *src) {}
void ibv_copy_qp_attr_from_kern(void *dst, const void *src) {}
void ibv_copy_path_rec_from_kern(void *dst, const void *src) {}
const char *ibv_get_sysfs_path(void) { return "/sys"; }
int ibv_read_sysfs_file(const char *dir, const char *file, char *buf, size_t size)
{
    return -1;
}
