/* pdkv verbs over several NICs: the function table, creation, completions and per-NIC counts.
 * The shape and the key format are in verbs_multi.h. Every verbs transport the messenger makes
 * is one of these (one NIC is the case N = 1), so nodes with different NIC counts speak the
 * same connection info and keys.
 * Compiled into the extension only with libibverbs (PDKV_HAVE_VERBS). */
#ifdef PDKV_HAVE_VERBS
#define _GNU_SOURCE
#include "verbs_multi.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

static void vm_destroy(pdkv_transport *base);

/* The core's poller resets the shared eventfd before it polls (poller.c), so a completion pushed
 * by any NIC after that reset rings it again: no NIC is polled without a fresh ring pending. */
static int vm_poll(pdkv_transport *base, pdkv_completion *out, int max)
{
    vm_transport *t = (vm_transport *)base;
    int n = 0;
    pthread_mutex_lock(&t->mu);
    for (; n < max && t->errq_count; n++) {
        out[n] = t->errq[t->errq_head];
        t->errq_head = (t->errq_head + 1) % t->errq_cap;
        t->errq_count--;
    }
    uint32_t first = t->next_nic_poll++ % t->num_nics;
    for (uint32_t k = 0; k < t->num_nics && n < max; k++) {
        uint32_t i = (first + k) % t->num_nics;
        int got = t->nic[i]->ops->poll(t->nic[i], out + n, max - n);
        for (int q = 0; q < got; q++) {
            const pdkv_completion *c = &out[n + q];
            vm_nic_count *cnt = &t->count[i];
            if (c->kind == PDKV_CQ_WRITE_DONE)
                cnt->writes_done++, cnt->bytes_done += c->len;
            else if (c->kind == PDKV_CQ_IMM)
                cnt->imms++, cnt->imm_bytes += c->len;
            else if (c->wr_id)
                cnt->errors++;
        }
        n += got > 0 ? got : 0;
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

static void vm_counters(pdkv_transport *base, pdkv_transport_counters *out)
{
    vm_transport *t = (vm_transport *)base;
    memset(out, 0, sizeof *out);
    for (uint32_t i = 0; i < t->num_nics; i++) {
        pdkv_transport_counters c;
        memset(&c, 0, sizeof c);
        t->nic[i]->ops->counters(t->nic[i], &c);
        out->refused_writes += c.refused_writes;
    }
}

static int vm_nic_stats(pdkv_transport *base, pdkv_nic_stats *out, int max)
{
    vm_transport *t = (vm_transport *)base;
    pthread_mutex_lock(&t->mu);
    int n = 0;
    for (; n < max && (uint32_t)n < t->num_nics; n++) {
        const vm_nic_count *c = &t->count[n];
        pdkv_nic_stats s = {.writes = c->writes, .bytes = c->bytes, .writes_done = c->writes_done,
                            .bytes_done = c->bytes_done, .errors = c->errors, .imms = c->imms,
                            .imm_bytes = c->imm_bytes, .qps = vm_num_qps(t, (uint32_t)n)};
        snprintf(s.name, sizeof s.name, "%s", t->names[n]);
        out[n] = s;
    }
    pthread_mutex_unlock(&t->mu);
    return (int)t->num_nics;
}

/* Keys name a region by its index (every NIC's key of it has the same one, verbs_multi.h). */
static int vm_same_region(pdkv_transport *base, uint64_t a, uint64_t b)
{
    (void)base;
    return VM_KEY_INDEX(a) && VM_KEY_INDEX(a) == VM_KEY_INDEX(b);
}

static int vm_event_fd(pdkv_transport *base) { return ((vm_transport *)base)->efd; }
static const char *vm_last_error(pdkv_transport *base) { (void)base; return vb_errbuf(); }

static const pdkv_transport_ops vm_ops = {
    .name = "verbs",
    .reg = vm_reg,
    .grant = vm_grant,
    .revoke = vm_revoke,
    .grant_range = vm_grant_range,
    .revoke_range = vm_revoke_range,
    .dereg = vm_dereg,
    .prepare = vm_prepare,
    .complete = vm_complete,
    .disconnect = vm_disconnect,
    .post = vm_post,
    .poll = vm_poll,
    .event_fd = vm_event_fd,
    .last_error = vm_last_error,
    .counters = vm_counters,
    .destroy = vm_destroy,
    .nic_key = vm_nic_key,
    .nic_stats = vm_nic_stats,
    .reg_device = vm_reg_device,
    .prepare_pairs = vm_prepare_pairs,
    .same_region = vm_same_region,
};

pdkv_transport *pdkv_verbs_multi_create(uint64_t node_id, const pdkv_verbs_opts *o, char *err,
                                        size_t errlen)
{
    uint32_t n = 0;
    while (o && o->nics && o->nics[n])
        n++;
    if (!n || n > VM_MAX_NICS) {
        snprintf(err, errlen, "verbs: 1..%d NIC names are supported per transport, got %u", VM_MAX_NICS, n);
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t k = 0; k < i; k++)
            if (!strcmp(o->nics[i], o->nics[k])) {
                snprintf(err, errlen, "verbs: NIC '%s' is named twice", o->nics[i]);
                return NULL;
            }
    if (o->remote_nics > VM_MAX_NICS) {
        snprintf(err, errlen, "verbs: remote_nics must be 0..%d, got %u", VM_MAX_NICS, o->remote_nics);
        return NULL;
    }
    vm_transport *t = calloc(1, sizeof *t);
    if (t) {
        t->regions = calloc(VM_MAX_REGIONS, sizeof *t->regions);
        t->conns = calloc(VM_MAX_CONNS, sizeof *t->conns);
    }
    if (!t || !t->regions || !t->conns) {
        snprintf(err, errlen, "verbs: out of memory");
        if (t)
            free(t->regions), free(t->conns), free(t);
        return NULL;
    }
    t->base.ops = &vm_ops;
    t->base.node_id = node_id;
    /* pairs toward as many peer NICs as a host can have, so hosts with different NIC counts (a TP8
     * prefill node, a TP1 decode node) connect without configuration; complete() drops the pairs
     * toward NICs the peer does not have */
    t->num_remote_default = o->remote_nics ? o->remote_nics : VM_MAX_NICS;
    t->qps_per_peer = o->qps_per_peer ? o->qps_per_peer : 1; /* as verbs.c counts them */
    pthread_mutex_init(&t->mu, NULL);
    t->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (t->efd < 0) {
        snprintf(err, errlen, "verbs: eventfd: %s", strerror(errno));
        vm_destroy(&t->base);
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        const char *one[2] = {o->nics[i], NULL};
        pdkv_verbs_opts c = *o;
        c.nics = one;
        if (!(t->nic[i] = vb_create_shared(node_id, &c, t->efd, err, errlen))) {
            vm_destroy(&t->base);
            return NULL;
        }
        t->num_nics = i + 1;
        snprintf(t->names[i], sizeof t->names[i], "%s", o->nics[i]);
    }
    return &t->base;
}

/* Each NIC's transport stops its progress thread and breaks its QPs first (vb_destroy), so no
 * completion can ring the shared eventfd once it is closed. */
static void vm_destroy(pdkv_transport *base)
{
    vm_transport *t = (vm_transport *)base;
    for (uint32_t i = 0; i < t->num_nics; i++)
        t->nic[i]->ops->destroy(t->nic[i]);
    if (t->efd >= 0)
        close(t->efd);
    pthread_mutex_destroy(&t->mu);
    free(t->errq);
    free(t->regions);
    free(t->conns);
    free(t);
}
#endif /* PDKV_HAVE_VERBS */
