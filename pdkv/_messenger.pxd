# C declarations of the messenger core and transports (pdkv/csrc), and the Messenger class's
# fields. Bodies live in _messenger.pyx.
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t, uint8_t


cdef extern from "transport.h" nogil:
    enum:
        PDKV_INFO_MAX
        PDKV_MAX_NICS
        PDKV_REASON_MAX
        PDKV_ERR_MAX
        PDKV_REG_DMABUF
        PDKV_REG_PEERMEM
        PDKV_REG_HMEM

    ctypedef struct pdkv_transport_counters:
        uint64_t refused_writes, refused_conns, pending_conns, rx_threads
        uint64_t copied_writes, copied_bytes, shared_writes

    ctypedef struct pdkv_nic_stats:
        char name[64]
        uint64_t writes, bytes, writes_done, bytes_done, errors, imms, imm_bytes, qps
    ctypedef struct pdkv_transport_ops:
        const char *name
        int (*reg)(pdkv_transport *t, void *addr, uint64_t len, uint64_t *key_out) noexcept nogil
        int (*grant)(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t *key_out) noexcept nogil
        int (*revoke)(pdkv_transport *t, uint64_t key, uint64_t peer) noexcept nogil
        int (*grant_range)(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off, uint64_t len,
                           uint64_t *key_out) noexcept nogil
        int (*revoke_range)(pdkv_transport *t, uint64_t key, uint64_t peer, uint64_t off,
                            uint64_t len) noexcept nogil
        void (*counters)(pdkv_transport *t, pdkv_transport_counters *out) noexcept nogil
        int (*prepare)(pdkv_transport *t, uint64_t peer, void *info_out, uint32_t *info_len, uint32_t *conn_out) noexcept nogil
        int (*complete)(pdkv_transport *t, uint32_t conn, const void *info, uint32_t info_len) noexcept nogil
        int (*set_token)(pdkv_transport *t, uint32_t conn, const void *token, uint32_t len) noexcept nogil
        int (*set_data_key)(pdkv_transport *t, uint32_t conn, const void *key, uint32_t len) noexcept nogil
        int (*disconnect)(pdkv_transport *t, uint32_t conn) noexcept nogil
        const char *(*last_error)(pdkv_transport *t) noexcept nogil
        int (*nic_key)(pdkv_transport *t, uint64_t key, uint32_t nic, uint64_t *key_out) noexcept nogil
        int (*nic_stats)(pdkv_transport *t, pdkv_nic_stats *out, int max) noexcept nogil
        int (*reg_device)(pdkv_transport *t, int fd, uint64_t offset, uint64_t len, void *addr,
                          uint64_t *key_out, uint32_t *method_out) noexcept nogil
        int (*prepare_pairs)(pdkv_transport *t, uint64_t peer, const uint8_t *pairs, void *info_out,
                             uint32_t *info_len, uint32_t *conn_out) noexcept nogil
        int (*share_pages)(pdkv_transport *t, uint32_t conn, uint64_t lkey, uint64_t loff, uint64_t rkey,
                           uint64_t roff, uint64_t len) noexcept nogil
        int (*unshare_pages)(pdkv_transport *t, uint32_t conn, uint64_t lkey, uint64_t loff,
                             uint64_t len) noexcept nogil
        int (*same_host)(pdkv_transport *t, uint64_t peer, int yes) noexcept nogil
        const char *(*route)(pdkv_transport *t, uint32_t conn, char *why, size_t n) noexcept nogil
        int (*reg_source)(pdkv_transport *t, void *addr, uint64_t len, uint64_t *key_out) noexcept nogil

    ctypedef struct pdkv_transport:
        const pdkv_transport_ops *ops
        uint64_t node_id

    ctypedef struct pdkv_tcp_opts:
        const char *host
        uint16_t port
        uint32_t num_streams
        uint32_t handshake_ms
        uint32_t max_pending
        uint32_t max_per_source

    ctypedef struct pdkv_verbs_opts:
        const char *const *nics
        uint8_t port_num
        int gid_index
        uint32_t qps_per_peer
        int isolate_peers
        uint32_t remote_nics

    ctypedef struct pdkv_libfabric_opts:
        const char *provider
        const char *const *domains
        int table_keys
        int device_memory
        int hmem_system

    pdkv_transport *pdkv_transport_open(const char *name, uint64_t node_id, const void *opts, char *err,
                                        size_t errlen)
    int pdkv_transport_available(const char *name)
    const char *pdkv_transport_name(unsigned i)
    int pdkv_transport_caps(const char *name)
    int pdkv_have_verbs()
    int pdkv_have_crypto()
    int pdkv_tcp_port(pdkv_transport *t)


cdef extern from "shm.h" nogil:
    ctypedef struct pdkv_shm_opts:
        const char *dir
        const char *fault_host_id
        uint32_t fault_fail_maps
        uint32_t lazy_alloc

cdef extern from "auto.h" nogil:
    ctypedef struct pdkv_auto_opts:
        pdkv_tcp_opts tcp
        pdkv_shm_opts shm


cdef extern from "core.h" nogil:
    enum:
        PDKV_EV_BATCH_DONE
        PDKV_EV_IMM_DONE
        PDKV_EV_ERROR

    ctypedef struct pdkv_event:
        uint32_t kind
        uint32_t imm
        uint64_t tag
        uint64_t peer
        uint64_t count
        uint64_t bytes
        uint32_t num_errors
        int32_t status
        char reason[160]

    ctypedef struct pdkv_page_batch:
        uint64_t lkey, rkey
        uint64_t src_off, dst_off
        uint64_t src_page_stride, dst_page_stride
        uint64_t src_seg_stride, dst_seg_stride
        uint64_t seg_len
        uint32_t num_segs
        uint32_t num_pages
        const int64_t *src_pages
        const int64_t *dst_pages
        uint32_t imm
        uint32_t has_imm

    ctypedef struct pdkv_core_opts:
        uint32_t spin_us, yield_us, sleep_us
        const int *cpus
        int num_cpus

    ctypedef struct pdkv_core_stats:
        uint64_t polls, posted_batches, last_post_poll, writes_posted, writes_done, imms
        uint64_t sleeps, blocks, queued

    ctypedef struct pdkv_core:
        pass

    pdkv_core *pdkv_core_create(pdkv_transport *t, const pdkv_core_opts *o, char *err, size_t errlen)
    void pdkv_core_destroy(pdkv_core *c)
    pdkv_transport *pdkv_core_transport(pdkv_core *c)
    int pdkv_core_event_fd(pdkv_core *c)
    int pdkv_core_drain(pdkv_core *c, pdkv_event *out, int max)
    int pdkv_core_expect(pdkv_core *c, uint32_t imm, uint64_t count, char *err)
    int64_t pdkv_core_forget(pdkv_core *c, uint32_t imm, char *err)
    int64_t pdkv_core_post(pdkv_core *c, uint32_t conn, const pdkv_page_batch *b, uint64_t tag, char *err)
    int pdkv_core_watch(pdkv_core *c, const int64_t *addr, uint32_t *id, char *err)
    int pdkv_core_unwatch(pdkv_core *c, uint32_t id, char *err)
    int pdkv_core_queue(pdkv_core *c, uint32_t watch, int64_t value, uint32_t conn,
                        const pdkv_page_batch *b, uint64_t tag, char *err)
    int pdkv_core_dereg(pdkv_core *c, uint64_t key, char *err)
    void pdkv_core_get_stats(pdkv_core *c, pdkv_core_stats *s)


cdef extern from "fake.h" nogil:
    enum pdkv_fake_fault_kind:
        PDKV_FAKE_DROP
        PDKV_FAKE_DELAY
        PDKV_FAKE_DUPLICATE
        PDKV_FAKE_CORRUPT
        PDKV_FAKE_ERROR
        PDKV_FAKE_VANISH

    int pdkv_fake_add_fault(pdkv_transport *t, int kind, uint64_t first, uint64_t count, uint32_t delay_us)


cdef extern from "tcp_wire.h" nogil:
    ctypedef struct c_tcp_frame "tcp_frame":
        uint32_t magic
        uint16_t type, flags
        uint32_t imm
        uint32_t check
        uint64_t key, off, len

    enum:
        TCP_TOKEN_LEN

    ctypedef struct c_tcp_hello "tcp_hello":
        uint32_t magic, version
        uint64_t node_id
        uint8_t token[32]
        uint32_t stream, num_streams

    ctypedef struct tcp_conninfo:
        uint32_t magic, version
        uint64_t node_id
        uint8_t token[32]
        uint16_t port
        char host[64]

    uint32_t TCP_HELLO_MAGIC, TCP_VERSION
    uint32_t tcp_frame_check(const c_tcp_frame *f)
    void tcp_frame_make(c_tcp_frame *f, uint16_t type, uint64_t key, uint64_t off, uint64_t len,
                        uint32_t imm, int has_imm)
    int tcp_frame_parse(const void *raw, c_tcp_frame *f, char *why, size_t n)


cdef class Messenger:
    cdef pdkv_core *core
    cdef pdkv_transport *t
    cdef readonly str transport
    cdef readonly object options  # the transport's options (pdkv.transports), as given
    cdef readonly uint64_t node_id
    cdef public tuple rank_nics  # verbs: per TP rank, NIC indices (pdkv/messenger.py); () otherwise
    cdef dict _pinned       # key -> the Python object whose memory is registered
    cdef set _source_only   # keys registered as a write source only (never granted)
    cdef dict _watched      # watch id -> the object holding the counter
    cdef int _busy          # calls now running without the GIL (close() waits for them)
    cdef int _closing       # close() has begun: every new call fails

    cdef int _check(self) except -1
    cdef int _enter(self) except -1
    cdef int _fill_batch(self, pdkv_page_batch *b, object src_pages, object dst_pages, list keep,
                         uint64_t lkey, uint64_t rkey, uint64_t seg_len, uint64_t src_page_stride,
                         uint64_t dst_page_stride, uint64_t src_off, uint64_t dst_off,
                         uint32_t num_segs, uint64_t src_seg_stride, uint64_t dst_seg_stride,
                         object imm) except -1
