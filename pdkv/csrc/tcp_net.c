/* tcp transport, leaf helpers: the per-thread error reason and blocking socket I/O.
 * Every other tcp_*.c file calls these; they call nothing of the transport (like hiredis' net.c). */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/socket.h>

#include "tcp_internal.h"

#define SOCK_BUF (4 << 20) /* per socket and direction: fewer wake-ups per MiB on loopback */

/* Per thread, so the poller and a Python thread posting at once don't mix their reasons. */
static __thread char tls_err[PDKV_ERR_MAX];

int tcp_err(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof(tls_err), fmt, ap);
    va_end(ap);
    return code;
}

char *tcp_errbuf(void) { return tls_err; }

void tcp_sockopts(int fd) {
    int one = 1, buf = SOCK_BUF;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

int tcp_send_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len) {
        ssize_t r = send(fd, p, len, MSG_NOSIGNAL);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -errno;
        p += r;
        len -= (size_t)r;
    }
    return 1;
}

/* 1: got all, 0: EOF, <0: -errno. */
int tcp_recv_all(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len) {
        ssize_t r = recv(fd, p, len, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -errno;
        if (r == 0) return 0;
        p += r;
        len -= (size_t)r;
    }
    return 1;
}
