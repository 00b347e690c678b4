/* Transport construction by name, so the Cython layer needs no #ifdefs. */
#include <stdio.h>
#include <string.h>

#include "fake.h"
#include "transport.h"

int pdkv_have_verbs(void) {
#ifdef PDKV_HAVE_VERBS
    return 1;
#else
    return 0;
#endif
}

pdkv_transport *pdkv_transport_create(const char *name, uint64_t node_id, const pdkv_tcp_opts *tcp,
                                      const pdkv_verbs_opts *verbs, char *err, size_t errlen) {
    if (!strcmp(name, "tcp")) return pdkv_tcp_create(node_id, tcp, err, errlen);
    if (!strcmp(name, "fake")) return pdkv_fake_create(node_id, err, errlen);
    if (!strcmp(name, "verbs")) {
#ifdef PDKV_HAVE_VERBS
        for (const char *const *n = verbs->nics; n && *n; n++)
            if (!strcmp(*n, "auto")) {
                snprintf(err, errlen, "verbs NIC 'auto' must be resolved to device names before the transport is created");
                return NULL;
            }
        return pdkv_verbs_multi_create(node_id, verbs, err, errlen);
#else
        (void)verbs;
        snprintf(err, errlen, "transport 'verbs' is not available: pdkv was built without libibverbs headers "
                              "(install libibverbs-dev / rdma-core and rebuild)");
        return NULL;
#endif
    }
    snprintf(err, errlen, "unknown transport '%s' (expected tcp, verbs or fake)", name);
    return NULL;
}
