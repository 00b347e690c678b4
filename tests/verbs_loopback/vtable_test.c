/* Drives pdkv's verbs transport (pdkv/csrc/verbs*.c) through its transport.h vtable, between
 * two processes (fork + a socketpair as the control channel that carries connection info).
 * Run with LD_LIBRARY_PATH pointing at the loopback libibverbs.so.1 (tests/verbs_loopback), or
 * without it for the "nodevice" scenario, which expects the real library's clear error.
 *
 *   vtable_test writes|bad|kill|frozen|errors|nodevice [qps_per_peer]
 *
 * Prints "OK <scenario>" and exits 0 on success; "FAIL ..." and exit 1 otherwise.
 */
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

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IONBF, 0);
    const char *scenario = argc > 1 ? argv[1] : "writes";
    if (argc > 2)
        nqps = (uint32_t)atoi(argv[2]);
    if (getenv("PDKV_TEST_NIC"))
        nic = getenv("PDKV_TEST_NIC");
    if (!strncmp(scenario, "target-", 7)) { /* a spawned peer: argv[3] is the control fd */
        CHECK(argc > 3, "target needs a control fd");
        ctl = atoi(argv[3]);
        if (!strcmp(scenario, "target-writes"))
            target_writes();
        else if (!strcmp(scenario, "target-bad"))
            target_bad();
        else if (!strcmp(scenario, "target-frozen"))
            target_frozen();
        else
            target_idle();
        return 0;
    }
    if (!strcmp(scenario, "nodevice")) {
        pdkv_verbs_opts o = {(const char *const[]){nic, NULL}, 1, -1, 1};
        char err[256] = "";
        pdkv_transport *t = pdkv_verbs_create(1, &o, err, sizeof err);
        CHECK(!t, "a verbs transport was created without an RDMA device");
        printf("error: %s\n", err);
    } else if (!strcmp(scenario, "errors")) {
        scenario_errors();
    } else if (!strcmp(scenario, "writes") || !strcmp(scenario, "bad")) {
        int writes = !strcmp(scenario, "writes");
        pid_t child = spawn(writes ? "target-writes" : "target-bad");
        writes ? writer_writes(child) : writer_bad();
        int status;
        CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && !WEXITSTATUS(status),
              "target process failed");
    } else if (!strcmp(scenario, "kill")) {
        writer_kill();
    } else if (!strcmp(scenario, "frozen")) {
        writer_frozen();
    } else {
        CHECK(0, "unknown scenario %s", scenario);
    }
    printf("OK %s\n", scenario);
    return 0;
}

