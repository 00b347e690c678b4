/* vtable_test scenarios "kill" (peer SIGKILLed mid-transfer, then a restarted peer) and
 * "errors" (clear errors for bad options and connection data; destroy with writes in flight). */
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

/* ---- "kill": the target dies mid-transfer (SIGKILL), then a restarted target works ---- */

void target_idle(void)
{
    pdkv_transport *t = make(2);
    uint64_t size, key;
    uint8_t *buf = map_dst(&size);
    CHECK(t->ops->reg(t, buf + GUARD + DST_SKEW, DST_LEN, &key) == 0, "reg");
    connect_peer(t, 1);
    ctl_send(&key, sizeof key);
    pdkv_completion c[64];
    int got = 0;
    for (;;) { /* count until killed, or until told how many to expect */
        got += wait_cq(t, c, 64, 100);
        struct pollfd pf = {ctl, POLLIN, 0};
        if (poll(&pf, 1, 0) == 1) {
            int want;
            ctl_recv(&want, sizeof want);
            for (double dl = now() + 10; got < want && now() < dl;)
                got += wait_cq(t, c, 64, 100);
            CHECK(got == want, "restarted target got %d of %d immediates", got, want);
            ctl_send(&got, sizeof got);
            break;
        }
    }
    t->ops->destroy(t);
}

void writer_kill(void)
{
    int fds0 = count_dir("/proc/self/fd"), threads0 = count_dir("/proc/self/task");
    pid_t child = spawn("target-idle");
    pdkv_transport *t = make(1);
    uint8_t *src = calloc(1, SRC_LEN);
    uint64_t lkey, rkey;
    CHECK(t->ops->reg(t, src, SRC_LEN, &lkey) == 0, "reg");
    uint32_t conn = connect_peer(t, 2);
    ctl_recv(&rkey, sizeof rkey);
    pdkv_write w[16];
    for (int i = 0; i < 16; i++)
        w[i] = (pdkv_write){lkey, 0, rkey, (uint64_t)i << 16, 65536, (uint64_t)i, 1, 1};
    long posted = 0, done = 0, errors = 0;
    pdkv_completion c[64];
    int rc = 0;
    for (int batch = 0; batch < 100000 && rc >= 0; batch++) {
        if (batch == 100) {
            CHECK(kill(child, SIGKILL) == 0, "SIGKILL");
            CHECK(waitpid(child, NULL, 0) == child, "waitpid");
        }
        rc = t->ops->post(t, conn, w, 16);
        posted += rc > 0 ? rc : 0;
        for (int n = t->ops->poll(t, c, 64), i = 0; i < n; i++)
            c[i].kind == PDKV_CQ_WRITE_DONE ? done++ : errors++;
    }
    CHECK(rc == -ECONNRESET, "posting to a dead peer must fail with ECONNRESET, got %d", rc);
    for (double dl = now() + 15; done + errors < posted && now() < dl;) {
        int n = wait_cq(t, c, 64, 100);
        for (int i = 0; i < n; i++) {
            CHECK(c[i].kind != PDKV_CQ_IMM, "imm");
            if (c[i].kind == PDKV_CQ_ERROR)
                CHECK(c[i].status == -ECONNRESET || c[i].status == -ECANCELED, "status %d: %s",
                      c[i].status, c[i].reason);
            c[i].kind == PDKV_CQ_WRITE_DONE ? done++ : errors++;
        }
    }
    CHECK(done + errors == posted && errors > 0, "posted %ld, done %ld, errors %ld", posted, done,
          errors);
    CHECK(t->ops->disconnect(t, conn) == 0, "disconnect");
    CHECK(t->ops->dereg(t, lkey) == 0, "every write is accounted, so dereg works: %s",
          t->ops->last_error(t));

    /* reconnect to a restarted peer */
    child = spawn("target-idle");
    CHECK(t->ops->reg(t, src, SRC_LEN, &lkey) == 0, "reg again");
    conn = connect_peer(t, 2);
    ctl_recv(&rkey, sizeof rkey);
    for (int i = 0; i < 16; i++)
        w[i].lkey = lkey, w[i].rkey = rkey;
    CHECK(t->ops->post(t, conn, w, 16) == 16, "post after restart: %s", t->ops->last_error(t));
    int want = 16, got = 0;
    ctl_send(&want, sizeof want);
    ctl_recv(&got, sizeof got);
    for (done = 0; done < 16;) {
        int n = wait_cq(t, c, 64, 5000);
        CHECK(n > 0, "writes after restart did not complete");
        for (int i = 0; i < n; i++)
        {
            CHECK(c[i].kind == PDKV_CQ_WRITE_DONE, "after restart: %s", c[i].reason);
            done++;
        }
    }
    int status;
    CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && !WEXITSTATUS(status),
          "restarted target failed");
    CHECK(t->ops->dereg(t, lkey) == 0, "dereg");
    close(ctl);
    ctl = -1;
    destroy_checked(t, fds0, threads0);
    free(src);
}

/* ---- "errors": clear errors for bad options and bad connection data, in one process ---- */

static void expect_create_error(const char *const *nics, uint32_t qps, const char *want)
{
    pdkv_verbs_opts o = {nics, 1, -1, qps};
    char err[256] = "";
    pdkv_transport *t = pdkv_verbs_create(1, &o, err, sizeof err);
    CHECK(!t && strstr(err, want), "expected an error with '%s', got '%s'", want, err);
    printf("error as expected: %s\n", err);
}

void scenario_errors(void)
{
    int fds0 = count_dir("/proc/self/fd"), threads0 = count_dir("/proc/self/task");
    expect_create_error((const char *const[]){"mlx5_9", NULL}, 1, "NIC 'mlx5_9' not found");
    expect_create_error((const char *const[]){"mlx5_9", NULL}, 1, "available: lo_verbs0");
    expect_create_error((const char *const[]){"auto", NULL}, 1, "must be resolved");
    expect_create_error((const char *const[]){nic, nic, NULL}, 1, "exactly one NIC");
    expect_create_error((const char *const[]){nic, NULL}, 17, "qps_per_peer");
    pdkv_transport *a = make(1), *b = make(9);
    uint64_t key;
    CHECK(a->ops->reg(a, NULL, 0, &key) == -EINVAL, "empty region");
    CHECK(a->ops->dereg(a, 12345) == -ENOENT && a->ops->grant(a, 12345, 2, NULL) == -ENOENT, "bad key");
    CHECK(a->ops->disconnect(a, 77) == -ENOENT, "bad conn");
    char ia[PDKV_INFO_MAX], ib[PDKV_INFO_MAX];
    uint32_t la, lb, ca, cb, cx;
    CHECK(a->ops->prepare(a, 2, ia, &la, &cx) == 0, "prepare");
    CHECK(a->ops->complete(a, cx, "garbage", 7) == -EPROTO, "garbage info");
    CHECK(b->ops->prepare(b, 1, ib, &lb, &cb) == 0, "prepare b");
    CHECK(a->ops->complete(a, cx, ib, lb) == -EPROTO && strstr(a->ops->last_error(a), "node 9"),
          "info from the wrong node: %s", a->ops->last_error(a));
    pdkv_write w = {0};
    CHECK(a->ops->post(a, cx, &w, 1) == -ENOTCONN, "post before complete");
    CHECK(a->ops->disconnect(a, cx) == 0, "disconnect prepared");
    /* two transports in one process also talk */
    CHECK(a->ops->prepare(a, 9, ia, &la, &ca) == 0, "prepare a");
    CHECK(a->ops->complete(a, ca, ib, lb) == 0 && b->ops->complete(b, cb, ia, la) == 0, "complete");
    static uint8_t src[1 << 16], dst[1 << 16];
    memset(src, 0x3c, sizeof src);
    uint64_t ks, kd;
    CHECK(a->ops->reg(a, src, sizeof src, &ks) == 0, "reg src");
    CHECK(b->ops->reg(b, dst, sizeof dst, &kd) == 0, "reg dst");
    pdkv_write many[200];
    for (int i = 0; i < 200; i++)
        many[i] = (pdkv_write){ks, 0, kd, 0, sizeof src, (uint64_t)i, 5, 1};
    CHECK(a->ops->post(a, ca, many, 1) == 1, "post");
    pdkv_completion c[4];
    CHECK(wait_cq(b, c, 4, 5000) == 1 && c[0].kind == PDKV_CQ_IMM && c[0].imm == 5 &&
          c[0].peer == 1, "same-process imm");
    CHECK(dst[0] == 0x3c && dst[sizeof dst - 1] == 0x3c, "same-process bytes");
    /* destroy with writes in flight: no crash, no hang, nothing left behind */
    CHECK(a->ops->post(a, ca, many, 200) == 200, "post many");
    a->ops->destroy(a);
    b->ops->destroy(b);
    CHECK(count_dir("/proc/self/fd") == fds0 && count_dir("/proc/self/task") == threads0,
          "leak after destroy with writes in flight");
}

/* ---- "frozen": the target process is stopped; posting never blocks, destroy returns ---- */

void target_frozen(void)
{
    pdkv_transport *t = make(2);
    uint64_t size, key;
    uint8_t *buf = map_dst(&size);
    CHECK(t->ops->reg(t, buf + GUARD + DST_SKEW, DST_LEN, &key) == 0, "reg");
    connect_peer(t, 1);
    ctl_send(&key, sizeof key);
    char done;
    ctl_recv(&done, 1); /* sent after the writer destroyed its transport */
    pdkv_completion c[64];
    for (int n; (n = wait_cq(t, c, 64, 200)) > 0;)
        for (int i = 0; i < n; i++)
            CHECK(c[i].kind == PDKV_CQ_IMM, "target: %s", c[i].reason);
    check_guards(buf);
    t->ops->destroy(t);
}

void writer_frozen(void)
{
    pid_t child = spawn("target-frozen");
    int fds0 = count_dir("/proc/self/fd"), threads0 = count_dir("/proc/self/task");
    pdkv_transport *t = make(1);
    uint8_t *src = calloc(1, SRC_LEN);
    uint64_t lkey, rkey;
    CHECK(t->ops->reg(t, src, SRC_LEN, &lkey) == 0, "reg");
    uint32_t conn = connect_peer(t, 2);
    ctl_recv(&rkey, sizeof rkey);
    int st;
    CHECK(kill(child, SIGSTOP) == 0 && waitpid(child, &st, WUNTRACED) == child && WIFSTOPPED(st),
          "SIGSTOP");
    pdkv_write w[32];
    for (int i = 0; i < 32; i++)
        w[i] = (pdkv_write){lkey, 0, rkey, (uint64_t)i << 16, 65536, (uint64_t)i, 3, 1};
    for (int b = 0; b < 100; b++) /* 3200 writes, 200 MiB: far beyond queues and buffers */
        CHECK(t->ops->post(t, conn, w, 32) == 32, "post to a frozen peer: %s",
              t->ops->last_error(t));
    CHECK(t->ops->dereg(t, lkey) == -EBUSY, "dereg with writes queued must be -EBUSY");
    destroy_checked(t, fds0, threads0); /* returns although the peer is frozen mid-transfer */
    CHECK(kill(child, SIGCONT) == 0, "SIGCONT");
    ctl_send("d", 1);
    CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && !WEXITSTATUS(st), "target failed");
    free(src);
}
