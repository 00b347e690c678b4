/* auto: a transport of two transports. A peer on this host (the control handshake says so, and
 * the shm connection then checks the boot id and reaches the peer's socket) is served by shm;
 * any other, or one whose shm connection fails, by tcp. Every region is registered with both;
 * a grant goes through the transport that carries the peer, and the key it returns says which
 * (SHM_TAG), so the writer posts each write through the one its key names. */
#ifndef PDKV_AUTO_H
#define PDKV_AUTO_H

#include "shm.h"
#include "transport.h"

typedef struct pdkv_auto_opts {
    pdkv_tcp_opts tcp;
    pdkv_shm_opts shm;
} pdkv_auto_opts;

pdkv_transport *pdkv_auto_create(uint64_t node_id, const pdkv_auto_opts *opts, char *err, size_t errlen);

#endif
