/* pdkv libfabric transport, leaf: libfabric itself, loaded when the first libfabric transport is
 * made (dlopen), not linked into the extension. Linking would load libfabric -- and through it
 * every provider library (libefa, libpsm2, ...) and the system's libibverbs -- into every
 * process that imports pdkv._messenger, whatever transport it uses: a process running verbs on
 * another libibverbs (the test suite's loopback device) could not even import it. Only the
 * entry points are looked up here; every other libfabric call goes through the objects' ops
 * tables (inline functions of the headers).
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>

static struct {
    int (*getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *,
                   struct fi_info **);
    void (*freeinfo)(struct fi_info *);
    struct fi_info *(*dupinfo)(const struct fi_info *);
    int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
    const char *(*strerror)(int);
} lib;
static char load_error[256];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load(void)
{
    void *h = dlopen("libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(load_error, sizeof load_error, "cannot load libfabric.so.1: %s (install "
                 "libfabric1 / libfabric-dev)", dlerror());
        return;
    }
    /* the symbol versions the headers' ABI was built against */
    *(void **)&lib.getinfo = dlvsym(h, "fi_getinfo", "FABRIC_1.3");
    *(void **)&lib.freeinfo = dlvsym(h, "fi_freeinfo", "FABRIC_1.3");
    *(void **)&lib.dupinfo = dlvsym(h, "fi_dupinfo", "FABRIC_1.3");
    *(void **)&lib.fabric = dlvsym(h, "fi_fabric", "FABRIC_1.1");
    *(void **)&lib.strerror = dlvsym(h, "fi_strerror", "FABRIC_1.0");
    if (!lib.getinfo || !lib.freeinfo || !lib.dupinfo || !lib.fabric || !lib.strerror) {
        snprintf(load_error, sizeof load_error, "libfabric.so.1 lacks fi_getinfo@FABRIC_1.3 or "
                 "another entry point of libfabric 1.9+ (too old?)");
        lib.getinfo = NULL;
    }
}

int fbl_load(void)
{
    pthread_once(&once, load);
    return lib.getinfo ? 0 : fb_fail(-ENODEV, "libfabric: %s", load_error);
}

/* Called only after fbl_load() succeeded (fabric_setup.c: the first thing create does). */
int fbl_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                const struct fi_info *hints, struct fi_info **info)
{
    return lib.getinfo(version, node, service, flags, hints, info);
}
void fbl_freeinfo(struct fi_info *info) { lib.freeinfo(info); }
struct fi_info *fbl_dupinfo(const struct fi_info *info) { return lib.dupinfo(info); }
int fbl_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context)
{
    return lib.fabric(attr, fabric, context);
}
const char *fbl_strerror(int errnum) { return lib.strerror ? lib.strerror(errnum) : "?"; }
#endif /* PDKV_HAVE_LIBFABRIC */
