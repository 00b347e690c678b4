/* tcp transport, leaf: authenticated encryption of a data stream (messenger.tls_data).
 *
 * Each (writer node, reader node, stream index) of a connection gets its own AES-256-GCM key,
 * HMAC-SHA256(data key, "pdkv tcp data v1" | writer | reader | stream), from the data key both
 * nodes derived from their authenticated control session (set_data_key); the nonce is a
 * per-stream record counter, so no (key, nonce) pair repeats. After the hello every frame is two
 * records: its 40-byte header, then its payload, each followed by a 16-byte tag. A record that
 * fails its tag breaks the stream like any bad frame.
 *
 * Built with libcrypto (PDKV_HAVE_CRYPTO, setup.py); without it asking for a sealed stream is
 * an error naming what is missing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "tcp_internal.h"

#ifdef PDKV_HAVE_CRYPTO
#include <openssl/evp.h>
#include <openssl/hmac.h>

int tcp_seal_init(tcp_seal *s, const uint8_t *data_key, uint64_t writer, uint64_t reader, uint32_t stream,
                  int encrypt, char *why, size_t n) {
    uint8_t info[16 + 8 + 8 + 4];
    memcpy(info, "pdkv tcp data v1", 16);
    memcpy(info + 16, &writer, 8);
    memcpy(info + 24, &reader, 8);
    memcpy(info + 32, &stream, 4);
    unsigned int klen = 0;
    memset(s, 0, sizeof(*s));
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    if (!ctx || !HMAC(EVP_sha256(), data_key, TCP_DATA_KEY_LEN, info, sizeof(info), s->key, &klen) ||
        klen != sizeof(s->key) ||
        (encrypt ? EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), NULL, s->key, NULL)
                 : EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), NULL, s->key, NULL)) != 1) {
        EVP_CIPHER_CTX_free(ctx);
        snprintf(why, n, "cannot set up AES-256-GCM for stream %u (libcrypto)", stream);
        return -EIO;
    }
    s->ctx = ctx;
    s->encrypt = encrypt;
    return 0;
}

void tcp_seal_free(tcp_seal *s) {
    if (s->ctx) EVP_CIPHER_CTX_free(s->ctx);
    memset(s, 0, sizeof(*s));
}

int tcp_seal_begin(tcp_seal *s) {
    uint8_t iv[12] = {0};
    uint64_t seq = s->seq++;
    memcpy(iv + 4, &seq, 8);
    EVP_CIPHER_CTX *ctx = s->ctx;
    /* the key schedule was set once at init: only the nonce changes per record */
    return (s->encrypt ? EVP_EncryptInit_ex(ctx, NULL, NULL, NULL, iv)
                       : EVP_DecryptInit_ex(ctx, NULL, NULL, NULL, iv)) == 1 ? 0 : -EIO;
}

int tcp_seal_update(tcp_seal *s, uint8_t *out, const uint8_t *in, size_t len) {
    while (len) {
        int chunk = len > (1u << 30) ? 1 << 30 : (int)len, got = 0;
        int ok = s->encrypt ? EVP_EncryptUpdate(s->ctx, out, &got, in, chunk)
                            : EVP_DecryptUpdate(s->ctx, out, &got, in, chunk);
        if (ok != 1 || got != chunk) return -EIO;
        out += chunk;
        in += chunk;
        len -= (size_t)chunk;
    }
    return 0;
}

int tcp_seal_end(tcp_seal *s, uint8_t tag[TCP_TAG_LEN]) {
    uint8_t rest[16];
    int got = 0;
    if (s->encrypt)
        return EVP_EncryptFinal_ex(s->ctx, rest, &got) == 1 &&
                       EVP_CIPHER_CTX_ctrl(s->ctx, EVP_CTRL_GCM_GET_TAG, TCP_TAG_LEN, tag) == 1
                   ? 0
                   : -EIO;
    if (EVP_CIPHER_CTX_ctrl(s->ctx, EVP_CTRL_GCM_SET_TAG, TCP_TAG_LEN, tag) != 1) return -EIO;
    return EVP_DecryptFinal_ex(s->ctx, rest, &got) == 1 ? 0 : -EBADMSG;
}

int tcp_seal_available(void) { return 1; }
int pdkv_have_crypto(void) { return 1; }

#else

int tcp_seal_init(tcp_seal *s, const uint8_t *data_key, uint64_t writer, uint64_t reader, uint32_t stream,
                  int encrypt, char *why, size_t n) {
    (void)data_key, (void)writer, (void)reader, (void)encrypt;
    memset(s, 0, sizeof(*s));
    snprintf(why, n, "stream %u: pdkv was built without libcrypto (install libssl-dev and rebuild)", stream);
    return -ENOTSUP;
}
void tcp_seal_free(tcp_seal *s) { memset(s, 0, sizeof(*s)); }
int tcp_seal_begin(tcp_seal *s) { (void)s; return -ENOTSUP; }
int tcp_seal_update(tcp_seal *s, uint8_t *out, const uint8_t *in, size_t len) {
    (void)s, (void)out, (void)in, (void)len;
    return -ENOTSUP;
}
int tcp_seal_end(tcp_seal *s, uint8_t tag[TCP_TAG_LEN]) { (void)s, (void)tag; return -ENOTSUP; }
int tcp_seal_available(void) { return 0; }
int pdkv_have_crypto(void) { return 0; }

#endif
