/* pdkv verbs transport, leaf: one memory registration of (part of) a region. Host memory and
 * peer memory (a device pointer the kernel resolves through nvidia-peermem) register by address;
 * a dma-buf region (GPU memory exported by the CUDA driver, verbs_gpudirect.c) registers every
 * MR — its own, each peer's local MR, each grant — from its dma-buf fd, at the same iova.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS); see verbs.c. */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_internal.h"

#include <errno.h>

struct ibv_mr *vb_mr_reg(struct ibv_pd *pd, const vb_region *r, uint64_t off, uint64_t len, int access)
{
    errno = 0;
    if (r->dmabuf)
        return ibv_reg_dmabuf_mr(pd, r->dmabuf_off + off, len, r->pgoff + off, r->dmabuf_fd, access);
    return ibv_reg_mr_iova(pd, r->addr + off, len, r->pgoff + off, access);
}
#endif /* PDKV_HAVE_VERBS */
