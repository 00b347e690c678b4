/* pdkv libfabric transport: the progress thread. It reads every connection's completion queue
 * (which is also what drives data progress on FI_PROGRESS_MANUAL providers such as tcp;ofi_rxm
 * and shm: a peer's writes into our memory advance only while we read), turns entries into pdkv
 * completions -- remote CQ data is an immediate that landed (PDKV_CQ_IMM), an entry with our
 * context a local write done -- and pumps backlogs that met FI_EAGAIN. An error entry is read
 * with fi_cq_readerr and reported with the provider's text (fi_cq_strerror); the connection is
 * then broken, as a verbs QP in error would be: its later writes fail, the caller reconnects.
 * Writes outstanding (or refused with FI_EAGAIN) with no progress for FB_STALL_MS break the
 * connection too (a peer that died: tcp;ofi_rxm may never fail them, nor finish connecting to
 * it), as the verbs NIC's retry limit would.
 * It spins briefly after work, then sleeps in growing steps up to FB_IDLE_MAX_US (software
 * providers offer no wait object every provider shares; a sleeping thread costs no CPU to speak
 * of, and the first entry after idling waits at most one step).
 * Compiled into the extension only with libfabric (PDKV_HAVE_LIBFABRIC); see fabric.c. */
#ifdef PDKV_HAVE_LIBFABRIC
#define _GNU_SOURCE
#include "fabric_internal.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define FB_BURST 64
#define FB_SPIN_PASSES 2000   /* empty passes (yielding) before sleeping */
#define FB_IDLE_MIN_US 20
#define FB_IDLE_MAX_US 1000
#define FB_FINAL_PASSES 20    /* at destroy, 1 ms apart */

static fb_pending *our_slot(fb_transport *t, fb_conn *c, void *ctx)
{
    fb_pending *p = ctx;
    if (!p || p < c->slots || p >= c->slots + t->tx_depth || !p->used)
        return NULL;
    return p;
}

static void done(fb_transport *t, fb_conn *c, fb_pending *p)
{
    if (t->regions[p->region].inflight)
        t->regions[p->region].inflight--;
    p->used = 0;
    c->outstanding--;
}

static void on_entry(fb_transport *t, fb_conn *c, const struct fi_cq_data_entry *e)
{
    pdkv_completion cp;
    memset(&cp, 0, sizeof cp);
    cp.peer = c->peer;
    /* our context first: some providers (sockets) flag the writer's own completion of a write
     * with data FI_REMOTE_CQ_DATA too; a peer's write carries no context of ours */
    fb_pending *p = our_slot(t, c, e->op_context);
    if (!p && (e->flags & FI_REMOTE_CQ_DATA)) {
        cp.kind = PDKV_CQ_IMM;
        cp.imm = (uint32_t)e->data;
        cp.len = e->len;
        t->dev[c->dev].nic.imms++, t->dev[c->dev].nic.imm_bytes += e->len;
        pdkv_cq_push(&t->cq, &cp);
        return;
    }
    if (!p)
        return; /* a completion we did not ask for (a provider's own): nothing to report */
    cp.kind = PDKV_CQ_WRITE_DONE;
    cp.wr_id = p->wr_id;
    cp.len = p->len;
    t->dev[c->dev].nic.writes_done++, t->dev[c->dev].nic.bytes_done += p->len;
    done(t, c, p);
    pdkv_cq_push(&t->cq, &cp);
}

static void on_error(fb_transport *t, fb_conn *c)
{
    struct fi_cq_err_entry err;
    memset(&err, 0, sizeof err);
    if (fi_cq_readerr(c->cq, &err, 0) < 0)
        return;
    char text[96] = "";
    const char *prov = fi_cq_strerror(c->cq, err.prov_errno, err.err_data, text, sizeof text);
    fb_pending *p = our_slot(t, c, err.op_context);
    int status = err.err ? -err.err : -EIO;
    if (p) {
        uint64_t wr_id = p->wr_id;
        t->dev[c->dev].nic.errors++;
        done(t, c, p);
        fb_push_error(t, wr_id, c->peer, status, "libfabric: write to peer %llu failed: %s (%s)",
                      (unsigned long long)c->peer, fbl_strerror(err.err), prov ? prov : "");
    } else {
        /* not one of our writes: the target side of a peer's write (refused by the provider) */
        t->refused_writes++;
        fb_push_error(t, 0, c->peer, status, "libfabric: a write from peer %llu failed here: %s "
                      "(%s)", (unsigned long long)c->peer, fbl_strerror(err.err), prov ? prov : "");
    }
    if (!c->broken) {
        c->broken = 1;
        fb_flush_backlog(t, c, -ECONNRESET, "the connection broke on an earlier error");
    }
}

/* The peer stopped completing our writes (it died or hangs; a provider may never fail them):
 * close the endpoint -- nothing of it can complete after that -- and fail what was outstanding.
 * The connection stays, broken, until disconnect(). */
static void stalled(fb_transport *t, fb_conn *c)
{
    char why[96];
    snprintf(why, sizeof why, "no completion from the peer in %d ms (it died or hangs)",
             FB_STALL_MS);
    fb_close_endpoint(c);
    fb_fail_outstanding(t, c, -ETIMEDOUT, why);
    c->broken = 1;
    fb_flush_backlog(t, c, -ETIMEDOUT, why);
}

/* One pass over every connection; called with t->mu held. Returns the work it found. */
static int pass(fb_transport *t)
{
    struct fi_cq_data_entry e[FB_BURST];
    int work = 0;
    for (uint32_t i = 0; i < t->conns_hi; i++) {
        fb_conn *c = &t->conns[i];
        if (!c->used || !c->cq)
            continue;
        for (int rounds = 0; rounds < 16; rounds++) {
            ssize_t n = fi_cq_read(c->cq, e, FB_BURST);
            if (n == -FI_EAGAIN)
                break;
            if (n == -FI_EAVAIL) {
                on_error(t, c);
                work++;
                continue;
            }
            if (n < 0) {
                fb_push_error(t, 0, c->peer, fb_errno((int)n), "libfabric: fi_cq_read for peer "
                              "%llu: %s", (unsigned long long)c->peer, fbl_strerror((int)-n));
                c->broken = 1;
                break;
            }
            for (ssize_t k = 0; k < n; k++)
                on_entry(t, c, &e[k]);
            work += (int)n;
            c->last_ns = fb_now_ns();
            if (n < FB_BURST)
                break;
        }
        if (c->bl_count && !c->broken)
            work += fb_pump(t, c);
        if ((c->outstanding || c->bl_count) && fb_now_ns() - c->last_ns > FB_STALL_MS * 1000000ull)
            stalled(t, c);
    }
    return work;
}

static void *progress_main(void *arg)
{
    fb_transport *t = arg;
    uint32_t idle = 0, sleep_us = FB_IDLE_MIN_US;
    while (!__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&t->mu);
        int work = pass(t);
        pthread_mutex_unlock(&t->mu);
        if (work) {
            idle = 0, sleep_us = FB_IDLE_MIN_US;
        } else if (++idle < FB_SPIN_PASSES) {
            sched_yield();
        } else {
            struct timespec ts = {0, (long)sleep_us * 1000};
            nanosleep(&ts, NULL);
            if (sleep_us < FB_IDLE_MAX_US)
                sleep_us *= 2;
        }
    }
    return NULL;
}

int fb_start_progress(fb_transport *t)
{
    int rc = pthread_create(&t->thread, NULL, progress_main, t);
    if (rc)
        return fb_fail(-rc, "libfabric: cannot start the progress thread: %s", strerror(rc));
    t->thread_started = 1;
    return 0;
}

void fb_stop_progress(fb_transport *t)
{
    if (!t->thread_started)
        return;
    __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
    pthread_join(t->thread, NULL);
    t->thread_started = 0;
    /* a few last passes: manual-progress providers retire the connections a peer just closed
     * only while their CQs are read (tcp;ofi_rxm otherwise keeps such a socket past fi_close) */
    for (int i = 0; i < FB_FINAL_PASSES; i++) {
        pthread_mutex_lock(&t->mu);
        pass(t);
        pthread_mutex_unlock(&t->mu);
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}
#endif /* PDKV_HAVE_LIBFABRIC */
