/* Transport construction by name (the transport seam), so the Cython layer needs no #ifdefs. */
#include <stdio.h>
#include <string.h>

#include "auto.h"
#include "fake.h"
#include "shm.h"
#include "transport.h"

int pdkv_have_verbs(void) {
#ifdef PDKV_HAVE_VERBS
    return 1;
#else
    return 0;
#endif
}

static pdkv_transport *open_tcp(uint64_t id, const void *o, char *err, size_t n) {
    static const pdkv_tcp_opts dflt = {.host = "127.0.0.1", .num_streams = 2};
    return pdkv_tcp_create(id, o ? o : &dflt, err, n);
}

static pdkv_transport *open_fake(uint64_t id, const void *o, char *err, size_t n) {
    (void)o;
    return pdkv_fake_create(id, err, n);
}

static pdkv_transport *open_shm(uint64_t id, const void *o, char *err, size_t n) {
    return pdkv_shm_create(id, o, err, n);
}

static pdkv_transport *open_auto(uint64_t id, const void *o, char *err, size_t n) {
    return pdkv_auto_create(id, o, err, n);
}

#ifdef PDKV_HAVE_VERBS
static pdkv_transport *open_verbs(uint64_t id, const void *o, char *err, size_t n) {
    const pdkv_verbs_opts *verbs = o;
    for (const char *const *nic = verbs ? verbs->nics : NULL; nic && *nic; nic++)
        if (!strcmp(*nic, "auto")) {
            snprintf(err, n, "verbs NIC 'auto' must be resolved to device names before the "
                             "transport is created");
            return NULL;
        }
    return pdkv_verbs_multi_create(id, verbs, err, n);
}
#else
#define open_verbs NULL
#endif

#ifdef PDKV_HAVE_LIBFABRIC
static pdkv_transport *open_libfabric(uint64_t id, const void *o, char *err, size_t n) {
    return pdkv_libfabric_create(id, o, err, n);
}
#else
#define open_libfabric NULL
#endif

/* One row per transport: its name, constructor and capabilities (enum pdkv_capability, mirrored
 * by pdkv/transports.py: tests/messenger/test_c_graph.py checks both agree). A NULL constructor:
 * not in this build, `missing` says how to get it. */
static const struct {
    const char *name;
    pdkv_transport_ctor create;
    int caps;
    const char *missing;
} TABLE[] = {
    {"tcp", open_tcp,
     PDKV_CAP_HOST_MEMORY | PDKV_CAP_PEER_ISOLATION | PDKV_CAP_SEALED_STREAMS | PDKV_CAP_INSTANT_GRANTS, NULL},
    {"verbs", open_verbs,
     PDKV_CAP_HOST_MEMORY | PDKV_CAP_DEVICE_MEMORY | PDKV_CAP_PEER_ISOLATION | PDKV_CAP_GPUDIRECT,
     "pdkv was built without libibverbs headers (install libibverbs-dev / rdma-core and rebuild)"},
    {"libfabric", open_libfabric, PDKV_CAP_HOST_MEMORY | PDKV_CAP_PEER_ISOLATION,
     "pdkv was built without libfabric headers (install libfabric-dev and rebuild)"},
    /* in-process: both ends are messengers of one process */
    {"fake", open_fake,
     PDKV_CAP_HOST_MEMORY | PDKV_CAP_PEER_ISOLATION | PDKV_CAP_SAME_HOST_ONLY | PDKV_CAP_INSTANT_GRANTS, NULL},
    /* same host only (complete() refuses a peer on another host); grants bound what the peer
     * maps, but it holds the whole file: no isolation from a hostile process of the same user */
    {"shm", open_shm, PDKV_CAP_HOST_MEMORY | PDKV_CAP_SAME_HOST_ONLY, NULL},
    /* shm to peers of this host, tcp to the others: only what both can do */
    {"auto", open_auto, PDKV_CAP_HOST_MEMORY, NULL},
};
#define NUM_TRANSPORTS (sizeof TABLE / sizeof TABLE[0])

pdkv_transport *pdkv_transport_open(const char *name, uint64_t node_id, const void *opts, char *err,
                                    size_t errlen) {
    for (size_t i = 0; i < NUM_TRANSPORTS; i++) {
        if (strcmp(name, TABLE[i].name)) continue;
        if (TABLE[i].create) return TABLE[i].create(node_id, opts, err, errlen);
        snprintf(err, errlen, "transport '%s' is not available: %s", name, TABLE[i].missing);
        return NULL;
    }
    size_t at = (size_t)snprintf(err, errlen, "unknown transport '%s' (expected", name);
    for (size_t i = 0; i < NUM_TRANSPORTS && at < errlen; i++)
        at += (size_t)snprintf(err + at, errlen - at, "%s %s", i ? "," : "", TABLE[i].name);
    if (at < errlen) snprintf(err + at, errlen - at, ")");
    return NULL;
}

int pdkv_transport_available(const char *name) {
    for (size_t i = 0; i < NUM_TRANSPORTS; i++)
        if (!strcmp(name, TABLE[i].name)) return TABLE[i].create != NULL;
    return 0;
}

const char *pdkv_transport_name(unsigned i) {
    return i < NUM_TRANSPORTS ? TABLE[i].name : NULL;
}

int pdkv_transport_caps(const char *name) {
    for (size_t i = 0; i < NUM_TRANSPORTS; i++)
        if (!strcmp(name, TABLE[i].name)) return TABLE[i].caps;
    return -1;
}
