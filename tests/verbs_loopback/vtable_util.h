/* Shared helpers of vtable_test (see vtable_test.c): control channel, transport set-up,
 * completion waits, the deterministic write plan and guard-byte checks. */
#ifndef VTABLE_UTIL_H
#define VTABLE_UTIL_H
#define _GNU_SOURCE
#include "transport.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "FAIL [pid %d] %s:%d: ", getpid(), __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, "\n");                                              \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

#define NUM_WRITES 3000
#define SRC_LEN (1u << 20)
#define DST_LEN (24u << 20)
#define GUARD 4096
#define DST_SKEW 100 /* the region starts mid-page: exercises the page-offset part of keys */

extern int ctl;          /* control channel to the peer process */
extern const char *nic;  /* device name (PDKV_TEST_NIC) */
extern uint32_t nqps;    /* qps_per_peer */

void ctl_send(const void *p, uint32_t len);
uint32_t ctl_recv(void *p, uint32_t max);
void barrier(void);
int count_dir(const char *path);
pdkv_transport *make(uint64_t id);
uint32_t connect_peer(pdkv_transport *t, uint64_t peer);
int wait_cq(pdkv_transport *t, pdkv_completion *out, int max, int timeout_ms);
double now(void);
uint8_t pattern(uint64_t i);
void plan(pdkv_write *w, int n, uint64_t lkey, uint64_t rkey);
uint8_t *map_dst(uint64_t *size);
void check_guards(const uint8_t *buf);
void destroy_checked(pdkv_transport *t, int fds0, int threads0);
pid_t spawn(const char *role);

/* scenarios */
void target_writes(void);
void writer_writes(pid_t child);
void target_bad(void);
void writer_bad(void);
void target_idle(void);
void writer_kill(void);
void target_frozen(void);
void writer_frozen(void);
void scenario_errors(void);

#endif
