/* Wire format of the tcp transport (host byte order: both ends are little-endian x86/arm).
 *
 * A stream starts with a hello from the writer (node id, a 32-byte token, stream index) answered
 * by an ACK frame (len 0: accepted, else a reason). The token is either the session token both
 * nodes were given for this connection by their authenticated control session (set_token: never
 * sent in the connection info) or, without one, the random token the receiver put in its info.
 * The receiver checks it before it accepts anything else on the stream.
 * Then DATA frames: a 40-byte header followed by `len` payload bytes that the receiver reads
 * straight into the registered region. The receiver answers a bad frame with an ERROR frame
 * (len bytes of reason) and closes; a writer that leaves on purpose sends BYE.
 *
 * The header carries a check word (a mix of every other field) so that a corrupted header is
 * refused before its key/offset are even looked up.
 */
#ifndef PDKV_TCP_WIRE_H
#define PDKV_TCP_WIRE_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define TCP_FRAME_MAGIC 0x464b4450u /* "PDKF" */
#define TCP_HELLO_MAGIC 0x484b4450u /* "PDKH" */
#define TCP_INFO_MAGIC 0x494b4450u  /* "PDKI" */
#define TCP_VERSION 2u
#define TCP_TOKEN_LEN 32
#define TCP_MAX_STREAMS 64 /* streams per connection (one bit each in the receiver's tcp_conn) */

enum tcp_frame_type { TCP_FR_DATA = 1, TCP_FR_ERROR = 2, TCP_FR_BYE = 3, TCP_FR_ACK = 4 };
#define TCP_FL_IMM 1u

typedef struct __attribute__((packed)) tcp_frame {
    uint32_t magic;
    uint16_t type, flags;
    uint32_t imm;
    uint32_t check;
    uint64_t key, off, len;
} tcp_frame;

typedef struct __attribute__((packed)) tcp_hello {
    uint32_t magic, version;
    uint64_t node_id;
    uint8_t token[TCP_TOKEN_LEN];
    uint32_t stream, num_streams;
} tcp_hello;

typedef struct __attribute__((packed)) tcp_conninfo {
    uint32_t magic, version;
    uint64_t node_id;
    uint8_t token[TCP_TOKEN_LEN]; /* random; unused when both ends were given a session token */
    uint16_t port;
    char host[64]; /* NUL-terminated numeric address */
} tcp_conninfo;

#define TCP_MAX_REASON 1024 /* longest ERROR/ACK payload a receiver accepts */

static inline uint32_t tcp_frame_check(const tcp_frame *f) {
    uint64_t h = ((uint64_t)f->magic << 32) ^ ((uint64_t)f->type << 16) ^ f->flags;
    h ^= ((uint64_t)f->imm << 29) ^ (f->key * 0x9E3779B97F4A7C15ull);
    h ^= (f->off + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull;
    h ^= (f->len ^ 0x94D049BB133111EBull) * 0xD6E8FEB86659FD93ull;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
    return (uint32_t)h ^ (uint32_t)(h >> 32);
}

static inline void tcp_frame_make(tcp_frame *f, uint16_t type, uint64_t key, uint64_t off,
                                  uint64_t len, uint32_t imm, int has_imm) {
    f->magic = TCP_FRAME_MAGIC;
    f->type = type;
    f->flags = has_imm ? TCP_FL_IMM : 0;
    f->imm = imm;
    f->key = key;
    f->off = off;
    f->len = len;
    f->check = 0;
    f->check = tcp_frame_check(f);
}

/* Parse a header from 40 raw bytes; 0, or -EPROTO with a reason. Says nothing about regions. */
static inline int tcp_frame_parse(const void *raw, tcp_frame *f, char *why, size_t n) {
    memcpy(f, raw, sizeof(*f));
    if (f->magic != TCP_FRAME_MAGIC) {
        snprintf(why, n, "bad frame magic 0x%08x (stream out of sync or not a pdkv peer)", f->magic);
        return -EPROTO;
    }
    uint32_t got = f->check;
    f->check = 0;
    uint32_t want = tcp_frame_check(f);
    f->check = got;
    if (got != want) {
        snprintf(why, n, "corrupted frame header (check 0x%08x, expected 0x%08x)", got, want);
        return -EPROTO;
    }
    if (f->type < TCP_FR_DATA || f->type > TCP_FR_ACK || (f->flags & ~TCP_FL_IMM)) {
        snprintf(why, n, "unknown frame type %u / flags 0x%x", f->type, f->flags);
        return -EPROTO;
    }
    if (f->type != TCP_FR_DATA && f->len > TCP_MAX_REASON) {
        snprintf(why, n, "control frame of %llu bytes (max %d)", (unsigned long long)f->len, TCP_MAX_REASON);
        return -EPROTO;
    }
    return 0;
}

#endif
