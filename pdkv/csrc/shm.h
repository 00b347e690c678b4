/* Same-host transport: the receiver's registered memory is shared; a grant maps just the granted
 * page-rounded range into the writer, a revoke unmaps it there; writes are memcpy's
 * (shm_internal.h). Both peers must be on one host and in one network namespace (the sockets
 * are abstract Unix sockets; the connection info carries the kernel's boot id). */
#ifndef PDKV_SHM_H
#define PDKV_SHM_H

#include "transport.h"

typedef struct pdkv_shm_opts {
    const char *dir; /* where the shared files are made (unnamed, O_TMPFILE); NULL: /dev/shm */
    /* fault injection (tests): NULL/"" or the boot id our connection info claims (a peer that
     * says it is on this host but is not); and how many of the grants peers send us next fail
     * to map (as a full address space or a vanished file would) */
    const char *fault_host_id;
    uint32_t fault_fail_maps;
    /* 0: a registered region's file is allocated whole at registration (a full dir fails then,
     * never later); 1: as its pages are first touched (only what is used costs memory, but a dir
     * that fills meanwhile makes that first touch a SIGBUS). Its free space is checked either way. */
    uint32_t lazy_alloc;
} pdkv_shm_opts;

pdkv_transport *pdkv_shm_create(uint64_t node_id, const pdkv_shm_opts *opts, char *err, size_t errlen);

#endif
