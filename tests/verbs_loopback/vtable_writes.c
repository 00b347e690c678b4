/* vtable_test scenarios "writes" (random writes land byte-exact, immediates counted exactly,
 * dereg with a write in flight is -EBUSY) and "bad" (foreign key, out-of-range offset and
 * overflowing address never touch memory and surface as errors on both sides). */
#include "vtable_util.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>

void target_writes(void)
{
    int fds0 = count_dir("/proc/self/fd"), threads0 = count_dir("/proc/self/task");
    pdkv_transport *t = make(2);
    connect_peer(t, 1);
    uint64_t size, key;
    uint8_t *buf = map_dst(&size), *dst = buf + GUARD + DST_SKEW;
    CHECK(t->ops->reg(t, dst, DST_LEN, &key) == 0, "reg: %s", t->ops->last_error(t));
    CHECK(t->ops->grant(t, key, 1, NULL) == 0, "grant");
    ctl_send(&key, sizeof key);
    static pdkv_write w[NUM_WRITES];
    plan(w, NUM_WRITES, 0, key);
    int want[7] = {0}, got[7] = {0}, total = 0, expected = 0;
    uint64_t want_bytes = 0, got_bytes = 0;
    for (int i = 0; i < NUM_WRITES; i++)
        if (w[i].has_imm)
            want[i % 7]++, expected++, want_bytes += w[i].len;
    pdkv_completion c[64];
    double deadline = now() + 30;
    while (total < expected && now() < deadline) {
        int n = wait_cq(t, c, 64, 100);
        for (int i = 0; i < n; i++) {
            CHECK(c[i].kind == PDKV_CQ_IMM, "unexpected completion %u: %s", c[i].kind, c[i].reason);
            CHECK(c[i].peer == 1, "imm from peer %llu", (unsigned long long)c[i].peer);
            CHECK(c[i].imm % 0x01010101u == 0 && c[i].imm / 0x01010101u < 7, "bad imm %x",
                  c[i].imm);
            got[c[i].imm / 0x01010101u]++;
            got_bytes += c[i].len;
            total++;
        }
    }
    CHECK(total == expected, "got %d immediates, expected %d", total, expected);
    for (int k = 0; k < 7; k++)
        CHECK(got[k] == want[k], "imm %d: %d landed, expected %d", k, got[k], want[k]);
    CHECK(got_bytes == want_bytes, "imm bytes %llu != %llu", (unsigned long long)got_bytes,
          (unsigned long long)want_bytes);
    uint64_t signal_;
    ctl_recv(&signal_, sizeof signal_); /* the writer saw all its writes complete */
    uint64_t cursor = 0;
    for (int i = 0; i < NUM_WRITES; i++) {
        for (; cursor < w[i].roff; cursor++)
            CHECK(dst[cursor] == 0, "gap byte %llu was written", (unsigned long long)cursor);
        for (uint64_t b = 0; b < w[i].len; b++, cursor++)
            CHECK(dst[cursor] == pattern(w[i].loff + b), "write %d byte %llu differs", i,
                  (unsigned long long)b);
    }
    for (; cursor < DST_LEN; cursor++)
        CHECK(dst[cursor] == 0, "byte %llu after the last write was written",
              (unsigned long long)cursor);
    check_guards(buf);
    ctl_send("v", 1);
    ctl_recv(&signal_, sizeof signal_); /* writer finished its dereg-in-flight check */
    CHECK(t->ops->dereg(t, key) == 0, "dereg dst: %s", t->ops->last_error(t));
    destroy_checked(t, fds0, threads0);
    munmap(buf, size);
}

void writer_writes(pid_t child)
{
    int fds0 = count_dir("/proc/self/fd"), threads0 = count_dir("/proc/self/task");
    pdkv_transport *t = make(1);
    uint32_t conn = connect_peer(t, 2);
    uint8_t *src = malloc(SRC_LEN);
    for (uint64_t i = 0; i < SRC_LEN; i++)
        src[i] = pattern(i);
    uint64_t lkey, rkey;
    CHECK(t->ops->reg(t, src, SRC_LEN, &lkey) == 0, "reg src: %s", t->ops->last_error(t));
    ctl_recv(&rkey, sizeof rkey);
    static pdkv_write w[NUM_WRITES];
    static uint8_t done[NUM_WRITES];
    plan(w, NUM_WRITES, lkey, rkey);
    for (int i = 0; i < NUM_WRITES; i += 50) {
        int n = NUM_WRITES - i < 50 ? NUM_WRITES - i : 50;
        CHECK(t->ops->post(t, conn, w + i, n) == n, "post: %s", t->ops->last_error(t));
    }
    pdkv_completion c[64];
    int total = 0;
    double deadline = now() + 30;
    while (total < NUM_WRITES && now() < deadline) {
        int n = wait_cq(t, c, 64, 100);
        for (int i = 0; i < n; i++) {
            CHECK(c[i].kind == PDKV_CQ_WRITE_DONE, "completion %u status %d: %s", c[i].kind,
                  c[i].status, c[i].reason);
            uint64_t k = c[i].wr_id - 1000;
            CHECK(k < NUM_WRITES && !done[k]++, "wr_id %llu reported twice or unknown",
                  (unsigned long long)c[i].wr_id);
            CHECK(c[i].len == w[k].len && c[i].peer == 2, "write done len/peer mismatch");
            total++;
        }
    }
    CHECK(total == NUM_WRITES, "%d of %d writes completed", total, NUM_WRITES);
    ctl_send(&lkey, sizeof lkey);
    char v;
    ctl_recv(&v, 1); /* target verified the bytes */

    /* dereg with a write in flight is -EBUSY: freeze the target so the write cannot finish */
    int st;
    CHECK(kill(child, SIGSTOP) == 0 && waitpid(child, &st, WUNTRACED) == child && WIFSTOPPED(st),
          "SIGSTOP"); /* waitpid: the stop has taken effect, not just been queued */
    pdkv_write one = w[5];
    one.wr_id = 77;
    CHECK(t->ops->post(t, conn, &one, 1) == 1, "post one");
    CHECK(t->ops->dereg(t, lkey) == -EBUSY, "dereg with a write in flight must be -EBUSY");
    CHECK(strstr(t->ops->last_error(t), "in flight"), "reason: %s", t->ops->last_error(t));
    CHECK(kill(child, SIGCONT) == 0, "SIGCONT");
    CHECK(wait_cq(t, c, 1, 5000) == 1 && c[0].kind == PDKV_CQ_WRITE_DONE && c[0].wr_id == 77,
          "the in-flight write did not complete");
    CHECK(t->ops->dereg(t, lkey) == 0, "dereg after completion: %s", t->ops->last_error(t));
    CHECK(t->ops->dereg(t, lkey) == -ENOENT, "second dereg must be -ENOENT");
    ctl_send(&lkey, sizeof lkey);
    CHECK(t->ops->disconnect(t, conn) == 0, "disconnect");
    destroy_checked(t, fds0, threads0);
    free(src);
}

/* ---- "bad": foreign key, out-of-range offset, overflowing address never touch memory ---- */

void target_bad(void)
{
    pdkv_transport *t = make(2);
    uint64_t size, key;
    uint8_t *buf = map_dst(&size), *dst = buf + GUARD + DST_SKEW;
    CHECK(t->ops->reg(t, dst, DST_LEN, &key) == 0, "reg");
    for (int round = 0; round < 4; round++) {
        uint32_t conn = connect_peer(t, 1);
        ctl_send(&key, sizeof key);
        pdkv_completion c[8];
        int n = wait_cq(t, c, 8, 5000);
        if (round < 3) { /* the responder QP breaks too and says so, naming the peer */
            CHECK(n == 1 && c[0].kind == PDKV_CQ_ERROR && c[0].status == -EACCES && c[0].peer == 1,
                  "round %d: target saw %d completions (kind %u status %d)", round, n,
                  n ? c[0].kind : 0, n ? c[0].status : 0);
            for (uint64_t i = 0; i < DST_LEN; i++)
                CHECK(dst[i] == 0, "round %d: byte %llu inside the region was written", round,
                      (unsigned long long)i);
        } else { /* a fresh connection after the errors works */
            CHECK(n == 1 && c[0].kind == PDKV_CQ_IMM && c[0].imm == 42 && c[0].len == 4096,
                  "good write after errors: %d completions", n);
            for (uint64_t i = 0; i < 4096; i++)
                CHECK(dst[512 + i] == pattern(i), "good write byte %llu", (unsigned long long)i);
        }
        check_guards(buf);
        barrier();
        CHECK(t->ops->disconnect(t, conn) == 0, "disconnect");
    }
    t->ops->destroy(t);
}

void writer_bad(void)
{
    pdkv_transport *t = make(1);
    uint8_t *src = malloc(SRC_LEN);
    for (uint64_t i = 0; i < SRC_LEN; i++)
        src[i] = pattern(i);
    uint64_t lkey, rkey;
    CHECK(t->ops->reg(t, src, SRC_LEN, &lkey) == 0, "reg");
    for (int round = 0; round < 4; round++) {
        uint32_t conn = connect_peer(t, 2);
        ctl_recv(&rkey, sizeof rkey);
        pdkv_write w[2] = {{lkey, 0, rkey, 512, 4096, 1, 42, 1}, {lkey, 0, rkey, 0, 64, 2, 7, 1}};
        pdkv_completion c[8];
        if (round == 0) {
            /* checks made before anything is posted */
            pdkv_write bad = w[0];
            bad.loff = SRC_LEN - 10;
            CHECK(t->ops->post(t, conn, &bad, 1) == -ERANGE, "local range check");
            bad = w[0];
            bad.lkey = lkey + (1ull << 44);
            CHECK(t->ops->post(t, conn, &bad, 1) == -ENOENT, "unknown local key");
            CHECK(t->ops->post(t, 999, w, 1) == -ENOTCONN, "unknown connection");
            CHECK(wait_cq(t, c, 8, 50) == 0, "a refused post produced completions");
            w[0].rkey ^= 0x5a5a; /* foreign key */
        } else if (round == 1) {
            w[0].roff = DST_LEN - 10; /* runs past the end */
            w[0].len = 100;
        } else if (round == 2) {
            w[0].roff = UINT64_MAX - 5; /* address + length overflows */
            w[0].len = 64;
        }
        int posted = round < 3 ? 2 : 1;
        CHECK(t->ops->post(t, conn, w, posted) == posted, "post: %s", t->ops->last_error(t));
        int n = 0;
        for (double dl = now() + 5; n < posted && now() < dl;)
            n += wait_cq(t, c + n, 8 - n, 100);
        if (round < 3) {
            CHECK(n == 2 && c[0].kind == PDKV_CQ_ERROR && c[0].wr_id == 1 && c[0].status == -EACCES,
                  "round %d: bad write: %d completions, first kind %u status %d", round, n,
                  c[0].kind, c[0].status);
            CHECK(strstr(c[0].reason, "peer 2"), "reason names the peer: %s", c[0].reason);
            CHECK(c[1].kind == PDKV_CQ_ERROR && c[1].wr_id == 2 && c[1].status == -ECANCELED,
                  "round %d: the write behind the bad one must be flushed", round);
            CHECK(t->ops->post(t, conn, w + 1, 1) == -ECONNRESET, "post on a broken connection");
        } else {
            CHECK(n == 1 && c[0].kind == PDKV_CQ_WRITE_DONE && c[0].wr_id == 1, "good write");
        }
        barrier();
        CHECK(t->ops->disconnect(t, conn) == 0, "disconnect");
    }
    CHECK(t->ops->dereg(t, lkey) == 0, "dereg: %s", t->ops->last_error(t));
    t->ops->destroy(t);
    free(src);
}
