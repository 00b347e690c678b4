/* pdkv libfabric transport, leaf: the per-thread error reason, libfabric codes as errno values,
 * error completions for the core, and growing arrays. Every other fabric file calls these;
 * they call nothing.
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int fb_grow(void **items, uint32_t *cap, size_t size, uint32_t first)
{
    uint32_t n = *cap ? *cap * 2 : first;
    void *a = realloc(*items, (size_t)n * size);
    if (!a)
        return fb_fail(-ENOMEM, "libfabric: out of memory");
    *items = a, *cap = n;
    return 0;
}

uint64_t fb_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Per thread, so the progress thread and a Python thread posting at once don't mix reasons. */
static __thread char tls_err[512];

const char *fb_errbuf(void) { return tls_err; }
void fb_clear_error(void) { tls_err[0] = 0; }

int fb_fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof tls_err, fmt, ap);
    va_end(ap);
    return code;
}

int fb_errno(int fi_rc)
{
    /* FI_E* below FI_ERRNO_OFFSET are errno values already; the libfabric-only ones map to the
     * nearest errno the Python layer knows */
    int e = fi_rc < 0 ? -fi_rc : fi_rc;
    if (e < FI_ERRNO_OFFSET)
        return -e;
    return e == FI_ETRUNC ? -EOVERFLOW : -EIO;
}

void fb_push_error(fb_transport *t, uint64_t wr_id, uint64_t peer, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pdkv_cq_vpushf(&t->cq, PDKV_CQ_ERROR, wr_id, peer, 0, status, 0, fmt, ap);
    va_end(ap);
}
#endif /* PDKV_HAVE_LIBFABRIC */
