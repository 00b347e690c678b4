/* Shared helpers of vtable_test: see vtable_util.h. */
#include "vtable_util.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>

int ctl = -1;
const char *nic = "lo_verbs0";
uint32_t nqps = 1;

void ctl_send(const void *p, uint32_t len)
{
    CHECK(write(ctl, &len, 4) == 4 && (len == 0 || write(ctl, p, len) == (ssize_t)len),
          "control send");
}

uint32_t ctl_recv(void *p, uint32_t max)
{
    uint32_t len = 0, got = 0;
    CHECK(read(ctl, &len, 4) == 4 && len <= max, "control recv (peer gone?)");
    while (got < len) {
        ssize_t n = read(ctl, (char *)p + got, len - got);
        CHECK(n > 0, "control recv body");
        got += (uint32_t)n;
    }
    return len;
}

void barrier(void)
{
    char b = 'b';
    ctl_send(&b, 1);
    ctl_recv(&b, 1);
}

int count_dir(const char *path)
{
    int n = 0;
    DIR *d = opendir(path);
    for (struct dirent *e; d && (e = readdir(d));)
        n += e->d_name[0] != '.';
    if (d)
        closedir(d);
    return n;
}

pdkv_transport *make(uint64_t id)
{
    const char *nics[] = {nic, NULL};
    pdkv_verbs_opts o = {nics, 1, -1, nqps};
    char err[256];
    pdkv_transport *t = pdkv_verbs_create(id, &o, err, sizeof err);
    CHECK(t, "create: %s", err);
    CHECK(!strcmp(t->ops->name, "verbs"), "name");
    return t;
}

uint32_t connect_peer(pdkv_transport *t, uint64_t peer)
{
    char info[PDKV_INFO_MAX], rinfo[PDKV_INFO_MAX];
    uint32_t len = 0, conn = 0;
    CHECK(t->ops->prepare(t, peer, info, &len, &conn) == 0, "prepare: %s", t->ops->last_error(t));
    ctl_send(info, len);
    uint32_t rl = ctl_recv(rinfo, sizeof rinfo);
    CHECK(t->ops->complete(t, conn, rinfo, rl) == 0, "complete: %s", t->ops->last_error(t));
    barrier(); /* both ends are RTS before anyone writes */
    return conn;
}

/* Waits up to timeout_ms for completions (through the event fd, as asyncio would). */
int wait_cq(pdkv_transport *t, pdkv_completion *out, int max, int timeout_ms)
{
    int n = t->ops->poll(t, out, max);
    if (n)
        return n;
    struct pollfd pf = {t->ops->event_fd(t), POLLIN, 0};
    poll(&pf, 1, timeout_ms);
    return t->ops->poll(t, out, max);
}

double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

uint8_t pattern(uint64_t i) { return (uint8_t)((i * 2654435761u) >> 13); }

/* The write plan both sides derive from one seed: disjoint destinations, random sizes. */
void plan(pdkv_write *w, int n, uint64_t lkey, uint64_t rkey)
{
    uint64_t s = 0x9e3779b97f4a7c15ull, cursor = 0;
    for (int i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        uint64_t len = i % 97 == 0 ? 0 : 1 + s % 8192;
        w[i] = (pdkv_write){.lkey = lkey, .loff = (s >> 20) % (SRC_LEN - len), .rkey = rkey,
                            .roff = cursor, .len = len, .wr_id = 1000 + (uint64_t)i,
                            .imm = (uint32_t)(i % 7) * 0x01010101u, .has_imm = i % 3 != 0};
        cursor += len + (s >> 40) % 64;
    }
    CHECK(cursor <= DST_LEN, "plan exceeds destination");
}

uint8_t *map_dst(uint64_t *size)
{
    *size = DST_LEN + 2 * GUARD + DST_SKEW;
    uint8_t *buf = mmap(NULL, *size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(buf != MAP_FAILED, "mmap");
    memset(buf, 0xA5, GUARD + DST_SKEW);
    memset(buf + GUARD + DST_SKEW + DST_LEN, 0xA5, GUARD);
    return buf;
}

void check_guards(const uint8_t *buf)
{
    for (uint64_t i = 0; i < GUARD + DST_SKEW; i++)
        CHECK(buf[i] == 0xA5, "guard byte before the region changed at %llu",
              (unsigned long long)i);
    for (uint64_t i = 0; i < GUARD; i++)
        CHECK(buf[GUARD + DST_SKEW + DST_LEN + i] == 0xA5, "guard byte after the region changed");
}

void destroy_checked(pdkv_transport *t, int fds0, int threads0)
{
    t->ops->destroy(t);
    CHECK(count_dir("/proc/self/fd") == fds0, "fd leak: %d -> %d", fds0,
          count_dir("/proc/self/fd"));
    CHECK(count_dir("/proc/self/task") == threads0, "thread leak: %d -> %d", threads0,
          count_dir("/proc/self/task"));
}

/* Targets run in a fresh exec of this program: a verbs process must not fork after it opened
 * a device (libibverbs state is per process), and the writer forks again to restart a peer. */
pid_t spawn(const char *role)
{
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, "socketpair");
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        /* NOTE: a writer that fails (exit) between SIGSTOP and SIGCONT must not leave a stopped
         * target behind: the target dies with its parent (SIGKILL ends stopped processes too). */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1)
            _exit(1);
        char fd[16], qps[16];
        snprintf(fd, sizeof fd, "%d", dup(sv[1])); /* dup drops CLOEXEC */
        snprintf(qps, sizeof qps, "%u", nqps);
        execl("/proc/self/exe", "vtable_test", role, qps, fd, (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    if (ctl >= 0)
        close(ctl);
    ctl = sv[0];
    return pid;
}
