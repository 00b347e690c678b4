/* pdkv verbs transport: registering GPU memory with the NIC (GPUDirect RDMA).
 *
 * Two ways, tried in this order (pdkv/gpu/gpudirect.py obtains the fd and reads the host facts):
 *  1. dma-buf: the CUDA driver exported the range as a dma-buf fd (cuMemGetHandleForAddressRange
 *     with CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) and ibv_reg_dmabuf_mr registers it. Needs Linux
 *     >= 5.12, rdma-core >= 34, a NIC driver with dma-buf support and NVIDIA's open kernel module.
 *     We keep a dup of the fd: each peer's protection domain and each grant registers the same
 *     dma-buf again (verbs_memreg.c); it is closed when the region is deregistered.
 *  2. peer memory: ibv_reg_mr on the device pointer, which the kernel resolves through the
 *     nvidia-peermem module (or nv_peer_mem) when it is loaded.
 * When neither works the error names both attempts with their errno and what each needs.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int vb_reg_device(pdkv_transport *base, int fd, uint64_t offset, uint64_t len, void *addr,
                  uint64_t *key_out, uint32_t *method_out)
{
    vb_transport *t = (vb_transport *)base;
    if (!len || (fd < 0 && !addr)) {
        vb_fail(t, "verbs: device memory registration needs a length and a dma-buf fd or a device "
                   "pointer (fd %d, addr %p, len %llu)", fd, addr, (unsigned long long)len);
        return -EINVAL;
    }
    int access = IBV_ACCESS_LOCAL_WRITE | (t->isolate ? 0 : IBV_ACCESS_REMOTE_WRITE);
    /* the iova keeps the address's page offset, as for host memory (keys carry it) */
    uint64_t pgoff = (addr ? (uintptr_t)addr : offset) & (t->page_size - 1);
    char first[240] = "no dma-buf fd was given";
    if (fd >= 0) {
        vb_region r = {.addr = addr, .len = len, .pgoff = pgoff, .dmabuf = 1, .dmabuf_off = offset};
        r.dmabuf_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (r.dmabuf_fd < 0) {
            snprintf(first, sizeof first, "cannot keep the dma-buf fd %d: %s", fd, strerror(errno));
        } else {
            struct ibv_mr *mr = vb_mr_reg(t->pd, &r, 0, len, access);
            if (mr) {
                *method_out = PDKV_REG_DMABUF;
                int rc = vb_add_region(t, mr, &r, key_out);
                if (rc)
                    close(r.dmabuf_fd);
                return rc;
            }
            int e = errno ? errno : EIO;
            close(r.dmabuf_fd);
            snprintf(first, sizeof first, "ibv_reg_dmabuf_mr(fd %d, offset %llu, %llu bytes) failed: %s "
                     "(needs Linux >= 5.12, rdma-core >= 34, NIC driver dma-buf support, NVIDIA's open "
                     "kernel module)", fd, (unsigned long long)offset, (unsigned long long)len,
                     strerror(e));
        }
    }
    char second[160] = "no device pointer was given";
    if (addr) {
        errno = 0;
        struct ibv_mr *mr = ibv_reg_mr_iova(t->pd, addr, len, pgoff, access);
        if (mr) {
            vb_region r = {.addr = addr, .len = len, .pgoff = pgoff};
            *method_out = PDKV_REG_PEERMEM;
            return vb_add_region(t, mr, &r, key_out);
        }
        int e = errno ? errno : EIO;
        snprintf(second, sizeof second, "ibv_reg_mr on the device pointer %p failed: %s (needs the "
                 "nvidia-peermem kernel module: `modprobe nvidia-peermem`)", addr, strerror(e));
    }
    vb_fail(t, "verbs: cannot register %llu bytes of device memory with NIC %s: dma-buf: %s; peer "
               "memory: %s", (unsigned long long)len, ibv_get_device_name(t->ctx->device), first, second);
    return -EOPNOTSUPP;
}
#endif /* PDKV_HAVE_VERBS */
