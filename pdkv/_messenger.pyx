# cython: language_level=3
"""The messenger core: one-sided page writes with immediates over tcp, verbs, libfabric or a fake.

A ``Messenger`` owns one transport and one poller thread (C, no GIL) that counts incoming
immediates, sums local write completions per batch and posts page batches when watched int64
counters reach their values. Results come back as ``Event`` tuples from ``drain()``; ``fileno()``
is readable whenever ``drain()`` may return something (``loop.add_reader(m.fileno(), ...)``).

NOTE: memory handed to ``register``/``watch`` stays referenced by the messenger until it is
deregistered/unwatched or the messenger is closed, so it cannot be freed under a pending write.
"""
import errno as _errno
import os
import socket
import time
from collections import namedtuple

import numpy as np

from cpython.buffer cimport PyBUF_ANY_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset, strlen
from libc.stdlib cimport free, malloc

include "_messenger_errors.pxi"

from pdkv import transports as _transports

HAVE_VERBS = bool(pdkv_have_verbs())
HAVE_CRYPTO = bool(pdkv_have_crypto())  # tcp sealed data streams (messenger.tls_data)
HAVE_LIBFABRIC = bool(pdkv_transport_available(b"libfabric"))


def _table_names():
    cdef unsigned i = 0
    out = []
    while pdkv_transport_name(i) != NULL:
        out.append(pdkv_transport_name(i).decode())
        i += 1
    return tuple(out)


_KNOWN = _table_names()  # every row of the C table (csrc/transports.c), built in or not


def transports():
    """Names of the transports this build can create."""
    return [n for n in _KNOWN if pdkv_transport_available(n.encode())]


def transport_capabilities(str name):
    """The capabilities (pdkv.transports.Capability) transport `name` declares in the C table;
    InvalidRequestError for a name not in it."""
    cdef int caps = pdkv_transport_caps(name.encode())
    if caps < 0:
        raise InvalidRequestError(_errno.EINVAL, f"unknown transport {name!r} (expected one of {', '.join(_KNOWN)})")
    return _transports.Capability(caps)


cdef int _c_strings(object names, const char **out, list keep, str what) except -1:
    """Fill out[0..16] with NUL-terminated copies of `names` (kept alive by `keep`), then NULL."""
    cdef int i
    names = [str(n).encode() for n in names]
    if len(names) > 16:
        raise InvalidRequestError(_errno.EINVAL, f"at most 16 {what}, got {len(names)}")
    keep.extend(names)
    for i in range(len(names)):
        out[i] = <const char *>names[i]
    out[len(names)] = NULL
    return 0


_CAP_IPC_LOCK = 14


def locked_memory_limit():
    """Bytes this process may lock (pin) for RDMA registrations, or None when there is no limit
    (RLIMIT_MEMLOCK unlimited, or the CAP_IPC_LOCK capability, which ignores the limit)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        if int(caps, 16) >> _CAP_IPC_LOCK & 1:
            return None
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def check_lockable(uint64_t nbytes, str what="the KV cache"):
    """Start-up check for the verbs transport: TransportUnavailableError naming the limit and the
    fix when `nbytes` (e.g. the KV cache about to be registered) cannot be locked in memory."""
    limit = locked_memory_limit()
    if limit is not None and nbytes > limit:
        raise TransportUnavailableError(
            _errno.ENOMEM, f"registering {what} ({nbytes / 2**20:.1f} MiB) for RDMA needs that much locked "
            f"memory, but this process may lock only {limit / 2**20:.1f} MiB (RLIMIT_MEMLOCK): run with "
            f"`ulimit -l unlimited` (systemd: LimitMEMLOCK=infinity; docker: --ulimit memlock=-1) or grant "
            f"CAP_IPC_LOCK")


cdef inline uint64_t _u64(object v, str name) except? 0:
    if v < 0:
        raise InvalidRequestError(_errno.EINVAL, f"{name} must be >= 0, got {v}")
    return v


cdef class Messenger:
    """A node's end of the KV messenger.

    transport: a name in the C table (transports(); csrc/transports.c), options: that transport's
    own options (pdkv.transports: TcpOptions, VerbsOptions, LibfabricOptions, FakeOptions; None:
    its defaults), kept as `options`; `capabilities` says what it can do. The poller spins for
    spin_us after its last work, yields for yield_us, then sleeps sleep_us per poll while
    batches are queued (or blocks when none are); cpus pins it.
    """

    def __cinit__(self):
        self.core = NULL
        self.t = NULL
        self._pinned = {}
        self._source_only = set()
        self._watched = {}
        self._busy = 0
        self._closing = 0
        self.rank_nics = ()

    def __init__(self, str transport="tcp", uint64_t node_id=0, options=None, *, int spin_us=50,
                 int yield_us=200, int sleep_us=20, cpus=None):
        cdef char err[PDKV_ERR_MAX]
        cdef pdkv_tcp_opts tcp
        cdef pdkv_verbs_opts verbs
        cdef pdkv_libfabric_opts fabric
        cdef pdkv_core_opts copts
        cdef int cpu_list[64]
        cdef pdkv_shm_opts shm
        cdef pdkv_auto_opts auto
        cdef const char *names[17]
        cdef const void *opts = NULL
        cdef list keep = []
        if transport not in _KNOWN:
            raise InvalidRequestError(_errno.EINVAL, f"cannot create transport {transport!r}: unknown transport "
                                      f"{transport!r} (expected one of {', '.join(_KNOWN)})")
        cls = _transports.OPTIONS.get(transport)
        if options is None and cls is not None:
            options = cls()
        if cls is None or type(options) is not cls:
            raise InvalidRequestError(_errno.EINVAL, f"transport {transport!r} takes "
                                      f"{cls.__name__ if cls else 'no options class'} options, got {options!r}")
        if spin_us < 0 or yield_us < 0 or sleep_us < 0:
            raise InvalidRequestError(_errno.EINVAL, "spin_us / yield_us / sleep_us must be >= 0")
        if cls is _transports.TcpOptions or cls is _transports.AutoOptions:
            topts = options.tcp if cls is _transports.AutoOptions else options
            if not 0 <= topts.port <= 65535:
                raise InvalidRequestError(_errno.EINVAL, f"port must be 0..65535, got {topts.port}")
            if topts.num_streams < 1:
                raise InvalidRequestError(_errno.EINVAL, f"num_streams must be >= 1, got {topts.num_streams}")
            keep.append(topts.host.encode())
            tcp.host = keep[0]
            tcp.port = topts.port
            tcp.num_streams = topts.num_streams
            tcp.handshake_ms = topts.handshake_ms
            tcp.max_pending = topts.max_pending
            tcp.max_per_source = topts.max_per_source
            opts = &tcp
        elif cls is _transports.VerbsOptions:
            if options.qps_per_peer < 1:
                raise InvalidRequestError(_errno.EINVAL, f"qps_per_peer must be >= 1, got {options.qps_per_peer}")
            if not 0 <= options.remote_nics <= 16:
                raise InvalidRequestError(_errno.EINVAL, f"remote_nics must be 0..16, got {options.remote_nics}")
            _c_strings(options.nics, names, keep, "NICs")
            verbs.nics = names
            verbs.port_num = options.port_num
            verbs.gid_index = options.gid_index
            verbs.qps_per_peer = options.qps_per_peer
            verbs.isolate_peers = options.isolate_peers
            verbs.remote_nics = options.remote_nics
            opts = &verbs
        elif cls is _transports.LibfabricOptions:
            _c_strings(options.domains, names, keep, "fabric domains")
            keep.append(options.provider.encode())
            fabric.provider = keep[-1]
            fabric.domains = names
            fabric.table_keys = options.table_keys
            fabric.device_memory = options.device_memory
            fabric.hmem_system = options.hmem_system
            opts = &fabric
        if cls is _transports.ShmOptions or cls is _transports.AutoOptions:
            keep.append(options.dir.encode())
            shm.dir = keep[-1]
            keep.append(options.fault_host_id.encode())
            shm.fault_host_id = keep[-1]
            shm.fault_fail_maps = options.fault_fail_maps
            shm.lazy_alloc = 0 if options.preallocate else 1
            opts = &shm
        if cls is _transports.AutoOptions:
            auto.tcp = tcp
            auto.shm = shm
            opts = &auto
        cpus = list(cpus or ())[:64]
        for i, c in enumerate(cpus):
            cpu_list[i] = c
        copts.spin_us = spin_us
        copts.yield_us = yield_us
        copts.sleep_us = sleep_us
        copts.cpus = cpu_list
        copts.num_cpus = len(cpus)
        err[0] = 0
        name_b = transport.encode()
        cdef const char *name_p = name_b
        cdef pdkv_transport *t
        with nogil:
            t = pdkv_transport_open(name_p, node_id, opts, err, sizeof(err))
        if t == NULL:
            raise TransportUnavailableError(_errno.ENODEV, f"cannot create transport {transport!r}: "
                                            f"{err.decode('utf-8', 'replace')}")
        with nogil:
            self.core = pdkv_core_create(t, &copts, err, sizeof(err))
        if self.core == NULL:
            raise MessengerError(_errno.EIO, f"cannot start the messenger: {err.decode('utf-8', 'replace')}")
        self.t = t
        self.transport = transport
        self.options = options
        self.node_id = node_id

    @property
    def capabilities(self):
        """What this transport can do (pdkv.transports.Capability), as its C row declares."""
        return transport_capabilities(self.transport)

    def __dealloc__(self):
        if self.core != NULL:
            with nogil:
                pdkv_core_destroy(self.core)
            self.core = NULL

    cdef int _check(self) except -1:
        if self.core == NULL or self._closing:
            raise MessengerError(_errno.EBADF, "the messenger is closed")
        return 0

    cdef int _enter(self) except -1:
        """Check, then count a call that is about to release the GIL: close() waits for it.
        NOTE: nothing between _enter() and `with nogil` may run Python code."""
        self._check()
        self._busy += 1
        return 0

    def close(self):
        """Stop the poller and the transport's threads, close every fd. Idempotent.

        Writes still in flight end without events (nobody is left to drain them)."""
        cdef pdkv_core *c
        if self.core == NULL or self._closing:
            return
        self._closing = 1  # new calls fail from here on
        while self._busy:  # other threads are inside calls that released the GIL
            time.sleep(0.001)
        c = self.core
        self.core = NULL
        self.t = NULL
        with nogil:
            pdkv_core_destroy(c)
        self._pinned.clear()
        self._watched.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self):
        return self.core == NULL or self._closing != 0

    @property
    def port(self):
        """The tcp listen port (None for other transports)."""
        self._check()
        p = pdkv_tcp_port(self.t)
        return p if p >= 0 else None

    def fileno(self):
        """An eventfd, readable when drain() may return events."""
        self._check()
        return pdkv_core_event_fd(self.core)

    # ---- memory ----

    def register(self, buf):
        """Register a contiguous buffer (numpy array, bytearray, memoryview...) -> key.

        The buffer object is kept alive until deregister()/close()."""
        cdef Py_buffer view
        self._check()
        try:
            PyObject_GetBuffer(buf, &view, PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE)
        except BufferError:
            PyObject_GetBuffer(buf, &view, PyBUF_ANY_CONTIGUOUS)  # read-only: a source only
        try:
            key = self.register_address(<uint64_t>view.buf, view.len)
        finally:
            PyBuffer_Release(&view)
        self._pinned[key] = buf
        return key

    def register_address(self, uint64_t addr, uint64_t length, bint source_only=False):
        """Register raw memory [addr, addr+length) -> key. The caller keeps it alive.

        source_only: the region is only ever written from, never granted to a peer (a prefill
        node's KV pool). shm/auto leave its memory as it is instead of moving it onto a shared
        file, so untouched pages stay unallocated; grant() and grant_range() of it are refused
        (InvalidRequestError naming the key) on every transport."""
        cdef uint64_t key = 0
        cdef int rc
        cdef const char *msg = NULL
        cdef bint source
        self._check()
        source = source_only and self.t.ops.reg_source != NULL
        self._enter()
        try:
            with nogil:
                if source:
                    rc = self.t.ops.reg_source(self.t, <void *>addr, length, &key)
                else:
                    rc = self.t.ops.reg(self.t, <void *>addr, length, &key)
                msg = self.t.ops.last_error(self.t) if rc < 0 else NULL
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, msg, "register")
        if source_only:
            self._source_only.add(key)
        return key

    def _refuse_source(self, uint64_t key):
        # NOTE: every transport refuses the same way, whether or not its C side knows the region's use
        if key in self._source_only:
            raise InvalidRequestError(_errno.EPERM, f"region 0x{key:x} was registered as a write source only "
                                      "(register_address(source_only=True)): it cannot be granted to a peer")

    def register_device(self, int fd, uint64_t offset, uint64_t length, uint64_t addr=0):
        """Register device (GPU) memory -> (key, "dmabuf" | "peermem" | "hmem").

        verbs (GPUDirect RDMA): first the dma-buf `fd` at `offset` (ibv_reg_dmabuf_mr; fd -1:
        skip; the fd is not taken: the transport keeps its own dup), then the device pointer
        `addr` (ibv_reg_mr through nvidia-peermem; 0: skip). libfabric (a provider with FI_HMEM,
        e.g. EFA): the dma-buf (FI_MR_DMABUF, libfabric >= 1.20), then the device pointer
        through FI_HMEM ("hmem"). TransportUnavailableError naming both attempts when neither
        works. pdkv.gpu.gpudirect.register_on_messenger obtains the fd from the CUDA driver."""
        cdef uint64_t key = 0
        cdef uint32_t method = 0
        cdef int rc
        cdef const char *msg = NULL
        self._check()
        if self.t.ops.reg_device == NULL:
            raise InvalidRequestError(_errno.EOPNOTSUPP, f"the {self.transport} transport cannot register "
                                      "device memory (verbs and libfabric with FI_HMEM can; it stages through host memory)")
        self._enter()
        try:
            with nogil:
                rc = self.t.ops.reg_device(self.t, fd, offset, length, <void *>addr, &key, &method)
                msg = self.t.ops.last_error(self.t) if rc < 0 else NULL
        finally:
            self._busy -= 1
        if rc < 0:
            if rc == -_errno.EOPNOTSUPP:
                raise TransportUnavailableError(-rc, f"register_device: {msg.decode('utf-8', 'replace')}")
            _raise(rc, msg, "register_device")
        return key, {PDKV_REG_DMABUF: "dmabuf", PDKV_REG_HMEM: "hmem"}.get(method, "peermem")

    def grant(self, uint64_t key, uint64_t peer):
        """Allow node `peer` to write anywhere in region `key` -> the key that peer must name
        in its writes (tcp/fake: `key`; verbs with isolate_peers: a key of the region's
        registration in that peer's protection domain, different per peer). Granting again
        returns the same key."""
        cdef int rc
        cdef uint64_t out = 0
        self._check()
        self._refuse_source(key)
        rc = self.t.ops.grant(self.t, key, peer, &out)
        if rc < 0:
            _raise(rc, self.t.ops.last_error(self.t), "grant")
        return out

    def nic_key(self, uint64_t key, uint32_t nic):
        """verbs, libfabric: the key of region `key` on NIC (libfabric: domain) number `nic` (an
        index into the transport's NIC / domain list). A write leaves through the NIC of its local
        key and lands through the NIC of its remote key; grant() on a NIC's key registers the grant
        on that NIC. tcp/fake have one path: `key` itself for nic 0, InvalidRequestError for any
        other."""
        cdef int rc
        cdef uint64_t out = 0
        self._check()
        if self.t.ops.nic_key == NULL:
            if nic:
                raise InvalidRequestError(_errno.EINVAL, f"the {self.transport} transport has one path, no NIC {nic}")
            return key
        rc = self.t.ops.nic_key(self.t, key, nic, &out)
        if rc < 0:
            _raise(rc, self.t.ops.last_error(self.t), "nic_key")
        return out

    def nic_stats(self):
        """Per NIC (verbs; libfabric: per domain; [] on tcp/fake): dicts of name, writes, bytes (posted through it),
        writes_done, bytes_done, errors, imms, imm_bytes (writes with an immediate that landed
        through it), qps (queue pairs on it now), in the order of the transport's NIC list."""
        cdef pdkv_nic_stats s[16]
        cdef int n, i
        self._check()
        if self.t.ops.nic_stats == NULL:
            return []
        n = self.t.ops.nic_stats(self.t, s, 16)
        out = []
        for i in range(min(n, 16)):
            out.append(dict(name=s[i].name.decode("utf-8", "replace"), writes=s[i].writes, bytes=s[i].bytes,
                            writes_done=s[i].writes_done, bytes_done=s[i].bytes_done, errors=s[i].errors,
                            imms=s[i].imms, imm_bytes=s[i].imm_bytes, qps=s[i].qps))
        return out

    def revoke(self, uint64_t key, uint64_t peer):
        """End `peer`'s whole-region grant of `key`: afterwards nothing it sends lands there.
        InvalidRequestError if it holds none; RegionBusyError (tcp/fake) while a write it
        allowed is landing (retry); verbs without isolate_peers cannot revoke (InvalidRequestError)."""
        cdef int rc
        self._check()
        rc = self.t.ops.revoke(self.t, key, peer)
        if rc < 0:
            _raise(rc, self.t.ops.last_error(self.t), "revoke")

    def grant_range(self, uint64_t key, uint64_t peer, uint64_t offset, uint64_t length):
        """Narrow grant: `peer` may write [offset, offset+length) of region `key` (region
        offsets, the ones writes use) -> the key for writes into that range (tcp/fake: `key`;
        verbs: a key of an MR covering exactly that range, needs isolate_peers). A peer's
        ranges of one region must not overlap; a write must lie inside one range, else it is
        refused before a byte lands (error event at both ends, the connection is closed)."""
        cdef int rc
        cdef uint64_t out = 0
        cdef const char *msg = NULL
        self._check()
        self._refuse_source(key)
        self._enter()
        try:  # NOTE: without the GIL: on verbs this registers an MR (a caller's thread may wait)
            with nogil:
                rc = self.t.ops.grant_range(self.t, key, peer, offset, length, &out)
                msg = self.t.ops.last_error(self.t) if rc < 0 else NULL
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, msg, "grant_range")
        return out

    def revoke_range(self, uint64_t key, uint64_t peer, uint64_t offset, uint64_t length):
        """End the narrow grant [offset, offset+length) of `key` to `peer` (exactly as granted;
        `key` may be the region's key or the range's). RegionBusyError (tcp/fake) while a write
        into the range is landing; afterwards nothing from `peer` lands in it."""
        cdef int rc
        cdef const char *msg = NULL
        self._enter()
        try:  # NOTE: without the GIL: on verbs this deregisters an MR
            with nogil:
                rc = self.t.ops.revoke_range(self.t, key, peer, offset, length)
                msg = self.t.ops.last_error(self.t) if rc < 0 else NULL
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, msg, "revoke_range")

    def share_pages(self, uint32_t conn, uint64_t lkey, uint64_t loff, uint64_t rkey, uint64_t roff,
                    uint64_t length):
        """shm: make [loff, loff+length) of local region `lkey` the memory of [roff, roff+length)
        of region `rkey` that the peer of `conn` granted us (page-aligned on both sides): what
        this process computes there is in the peer's memory, and a write from that range to that
        range moves nothing (``shared_writes`` in stats()). Undone by unshare_pages, or when the
        grant is revoked or the connection ends. Other transports: InvalidRequestError."""
        cdef int rc
        cdef const char *msg = NULL
        self._check()
        if self.t.ops.share_pages == NULL:
            raise InvalidRequestError(_errno.EOPNOTSUPP, f"transport {self.transport} cannot share pages")
        self._enter()
        try:  # NOTE: without the GIL: a revoke racing it holds the same lock in the listener
            with nogil:
                rc = self.t.ops.share_pages(self.t, conn, lkey, loff, rkey, roff, length)
                msg = self.t.ops.last_error(self.t) if rc < 0 else NULL
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, msg, "share_pages")

    def unshare_pages(self, uint32_t conn, uint64_t lkey, uint64_t loff, uint64_t length):
        """Give [loff, loff+length) of local region `lkey` its own memory back (its contents from
        before share_pages); a range not shared (any more) is no error."""
        cdef int rc
        cdef const char *msg = NULL
        self._check()
        if self.t.ops.unshare_pages == NULL:
            return
        self._enter()
        try:
            with nogil:
                rc = self.t.ops.unshare_pages(self.t, conn, lkey, loff, length)
                msg = self.t.ops.last_error(self.t) if rc < 0 else NULL
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, msg, "unshare_pages")

    def deregister(self, uint64_t key):
        """Forget region `key`. RegionBusyError while writes from/into it are in flight or queued."""
        cdef char err[PDKV_ERR_MAX]
        cdef int rc
        self._check()
        err[0] = 0
        self._enter()
        try:
            with nogil:
                rc = pdkv_core_dereg(self.core, key, err)
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, err, "deregister")
        self._pinned.pop(key, None)
        self._source_only.discard(key)

    # ---- connections ----

    def prepare(self, uint64_t peer, bytes token=None, pairs=None, bytes data_key=None, same_host=None):
        """Start a connection to node `peer` -> (conn, info bytes for the peer's complete()).

        pairs (verbs over several NICs; ignored on tcp/fake, which have one path): the (local
        NIC, remote NIC) index pairs the connection's writes can use -- queue pairs are made for
        those only (None: for every pair), and a write on another pair is refused. Both sides
        name their own NIC first; a pair is connected when both asked for it (the disagg nodes
        derive them from the shard plan: pdkv.disagg.sharded.link_pairs).

        token: 16..32 bytes both nodes derived from their authenticated control session for
        this connection (e.g. an HMAC of the handshake's nonces). tcp: the peer's data streams
        must present it in their first frame, before anything is accepted, else they are closed
        unread; ours present it; it is never put in `info`, so a copy of the info alone cannot
        open the connection. Both ends must pass the same token (or neither). verbs/fake: not
        needed (the queue pairs are bound by the info exchange itself) and ignored.

        data_key (tcp only, messenger.tls_data): 32 bytes both nodes derived from the same
        session: every stream of the connection is encrypted and authenticated (AES-256-GCM
        records, a key per writer, reader and stream). Both ends pass the same key (or neither).
        Another transport, or a build without libcrypto: an error saying so.

        same_host (auto only; ignored elsewhere): whether the control handshake found the peer
        on this host (its HELLO's host identity is ours): auto offers it shm only then."""
        cdef char *info
        cdef uint32_t n = 0, conn = 0
        cdef int rc
        cdef const char *msg = NULL
        cdef const char *tok = NULL
        cdef uint32_t tok_len = 0
        cdef const char *dkey = NULL
        if data_key is not None:
            if len(data_key) != 32:
                raise InvalidRequestError(_errno.EINVAL, f"a data key must be 32 bytes, got {len(data_key)}")
            if self.t.ops.set_data_key == NULL:
                raise InvalidRequestError(_errno.EINVAL, f"messenger.tls_data: the {self.transport} transport "
                                          "has no encrypted data streams (tcp only)")
            dkey = data_key
        if token is not None:
            if not 16 <= len(token) <= 32:
                raise InvalidRequestError(_errno.EINVAL, f"a session token must be 16..32 bytes, got {len(token)}")
            tok = token
            tok_len = len(token)
        cdef uint8_t mask[PDKV_MAX_NICS * PDKV_MAX_NICS]
        cdef bint masked = pairs is not None and self.t.ops.prepare_pairs != NULL
        if masked:
            memset(mask, 0, sizeof(mask))
            for i, j in pairs:
                if not (0 <= i < PDKV_MAX_NICS and 0 <= j < PDKV_MAX_NICS):
                    raise InvalidRequestError(_errno.EINVAL, f"queue pair ({i}, {j}): NIC indices are 0..{PDKV_MAX_NICS - 1}")
                mask[i * PDKV_MAX_NICS + j] = 1
        self._check()
        info = <char *>malloc(PDKV_INFO_MAX)  # verbs: one blob per (local NIC, remote NIC) pair
        if info == NULL:
            raise MemoryError()
        cdef int same = 1 if same_host else 0
        cdef bint hint = same_host is not None and self.t.ops.same_host != NULL
        self._enter()
        try:
            with nogil:
                if hint:
                    self.t.ops.same_host(self.t, peer, same)
                if masked:
                    rc = self.t.ops.prepare_pairs(self.t, peer, mask, info, &n, &conn)
                else:
                    rc = self.t.ops.prepare(self.t, peer, info, &n, &conn)
                if rc == 0 and tok != NULL and self.t.ops.set_token != NULL:
                    rc = self.t.ops.set_token(self.t, conn, tok, tok_len)
                    if rc < 0:
                        msg = self.t.ops.last_error(self.t)
                        self.t.ops.disconnect(self.t, conn)
                elif rc < 0:
                    msg = self.t.ops.last_error(self.t)
                if rc == 0 and dkey != NULL:
                    rc = self.t.ops.set_data_key(self.t, conn, dkey, 32)
                    if rc < 0:
                        msg = self.t.ops.last_error(self.t)
                        self.t.ops.disconnect(self.t, conn)
        finally:
            self._busy -= 1
        try:
            if rc < 0:
                _raise(rc, msg, "prepare")
            return conn, info[:n]
        finally:
            free(info)

    def complete(self, uint32_t conn, bytes info):
        """Finish connection `conn` with the peer's info (from its prepare())."""
        cdef const char *p = info
        cdef uint32_t n = len(info)
        cdef int rc
        cdef const char *msg = NULL
        self._check()
        self._enter()
        try:
            with nogil:
                rc = self.t.ops.complete(self.t, conn, p, n)
                msg = self.t.ops.last_error(self.t) if rc < 0 else NULL
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, msg, "complete")

    def route(self, uint32_t conn):
        """(the transport carrying ``conn``, why it is not shm or ""): auto's choice for that
        connection; ``conn`` 0: (None, a region shm could not share or ""). Other transports:
        (their own name, "")."""
        cdef char why[PDKV_REASON_MAX]
        cdef const char *name
        self._check()
        if self.t.ops.route == NULL:
            return (None if conn == 0 else self.transport), ""
        why[0] = 0
        name = self.t.ops.route(self.t, conn, why, sizeof(why))
        return (None if name == NULL else name.decode()), why.decode("utf-8", "replace")

    def disconnect(self, uint32_t conn):
        """Drop `conn`: its pending writes end with errors; its threads are joined."""
        cdef int rc
        cdef const char *msg = NULL
        self._check()
        self._enter()
        try:
            with nogil:
                rc = self.t.ops.disconnect(self.t, conn)
                msg = self.t.ops.last_error(self.t) if rc < 0 else NULL
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, msg, "disconnect")

    # ---- writes ----

    cdef int _fill_batch(self, pdkv_page_batch *b, object src_pages, object dst_pages, list keep,
                         uint64_t lkey, uint64_t rkey, uint64_t seg_len, uint64_t src_page_stride,
                         uint64_t dst_page_stride, uint64_t src_off, uint64_t dst_off,
                         uint32_t num_segs, uint64_t src_seg_stride, uint64_t dst_seg_stride,
                         object imm) except -1:
        cdef const int64_t[::1] sp = np.ascontiguousarray(src_pages, dtype=np.int64).reshape(-1)
        cdef const int64_t[::1] dp = np.ascontiguousarray(dst_pages, dtype=np.int64).reshape(-1)
        if sp.shape[0] != dp.shape[0]:
            raise InvalidRequestError(_errno.EINVAL, f"src_pages has {sp.shape[0]} pages, dst_pages {dp.shape[0]}")
        if sp.shape[0] >= 2 ** 32:
            raise InvalidRequestError(_errno.EINVAL, "too many pages in one batch")
        keep.append(sp)
        keep.append(dp)
        memset(b, 0, sizeof(pdkv_page_batch))
        b.lkey = lkey
        b.rkey = rkey
        b.seg_len = seg_len
        b.src_page_stride = src_page_stride
        b.dst_page_stride = dst_page_stride
        b.src_off = src_off
        b.dst_off = dst_off
        b.num_segs = num_segs
        b.src_seg_stride = src_seg_stride
        b.dst_seg_stride = dst_seg_stride
        b.num_pages = <uint32_t>sp.shape[0]
        b.src_pages = &sp[0] if sp.shape[0] else NULL
        b.dst_pages = &dp[0] if dp.shape[0] else NULL
        if imm is not None:
            if not 0 <= imm < 2 ** 32:
                raise InvalidRequestError(_errno.EINVAL, f"imm must be a 32-bit unsigned value, got {imm}")
            b.imm = imm
            b.has_imm = 1
        return 0

    def write(self, uint32_t conn, uint64_t lkey, uint64_t loff, uint64_t rkey, uint64_t roff,
              uint64_t length, imm=None, uint64_t tag=0):
        """One write: lkey@loff -> rkey@roff, `length` bytes. A batch_done(tag) event follows."""
        return self.write_pages(conn, lkey, rkey, [0], [0], seg_len=length, src_off=loff, dst_off=roff,
                                imm=imm, tag=tag)

    def write_pages(self, uint32_t conn, uint64_t lkey, uint64_t rkey, src_pages, dst_pages, *,
                    uint64_t seg_len, uint64_t src_page_stride=0, uint64_t dst_page_stride=0,
                    uint64_t src_off=0, uint64_t dst_off=0, uint32_t num_segs=1,
                    uint64_t src_seg_stride=0, uint64_t dst_seg_stride=0, imm=None, uint64_t tag=0):
        """Post one write per (page, segment) now; returns the number of writes.

        src_pages, dst_pages: int sequences, shape [num_pages]. Write (i, s) copies seg_len bytes
        from src_off + src_pages[i]*src_page_stride + s*src_seg_stride of lkey to the same
        expression with dst_* of rkey, each carrying `imm` if given."""
        cdef pdkv_page_batch b
        cdef char err[PDKV_ERR_MAX]
        cdef int64_t rc
        keep = []
        self._check()
        self._fill_batch(&b, src_pages, dst_pages, keep, lkey, rkey, seg_len, src_page_stride,
                         dst_page_stride, src_off, dst_off, num_segs, src_seg_stride, dst_seg_stride, imm)
        err[0] = 0
        self._enter()
        try:
            with nogil:
                rc = pdkv_core_post(self.core, conn, &b, tag, err)
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, err, "write")
        return rc

    # ---- counters ----

    def watch(self, buf, Py_ssize_t index=0):
        """Watch int64 element `index` of a writable buffer (numpy int64 array...) -> watch id."""
        arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.int64)
        if not 0 <= index < arr.shape[0]:
            raise InvalidRequestError(_errno.EINVAL, f"counter index {index} outside a buffer of {arr.shape[0]} int64")
        w = self.watch_address(arr.ctypes.data + 8 * index)
        self._watched[w] = buf
        return w

    def watch_address(self, uint64_t addr):
        """Watch the int64 at `addr` (8-byte aligned; the caller keeps it alive) -> watch id."""
        cdef char err[PDKV_ERR_MAX]
        cdef uint32_t wid = 0
        cdef int rc
        self._check()
        rc = pdkv_core_watch(self.core, <const int64_t *>addr, &wid, err)
        if rc < 0:
            _raise(rc, err, "watch")
        return wid

    def unwatch(self, uint32_t watch):
        """Stop watching; its queued batches end with batch_done status -ECANCELED."""
        cdef char err[PDKV_ERR_MAX]
        cdef int rc
        self._check()
        rc = pdkv_core_unwatch(self.core, watch, err)
        if rc < 0:
            _raise(rc, err, "unwatch")
        self._watched.pop(watch, None)

    def queue_pages(self, uint32_t watch, int64_t value, uint32_t conn, uint64_t lkey, uint64_t rkey,
                    src_pages, dst_pages, *, uint64_t seg_len, uint64_t src_page_stride=0,
                    uint64_t dst_page_stride=0, uint64_t src_off=0, uint64_t dst_off=0,
                    uint32_t num_segs=1, uint64_t src_seg_stride=0, uint64_t dst_seg_stride=0,
                    imm=None, uint64_t tag=0):
        """Like write_pages, but posted by the poller once the watched counter is >= value."""
        cdef pdkv_page_batch b
        cdef char err[PDKV_ERR_MAX]
        cdef int rc
        keep = []
        self._check()
        self._fill_batch(&b, src_pages, dst_pages, keep, lkey, rkey, seg_len, src_page_stride,
                         dst_page_stride, src_off, dst_off, num_segs, src_seg_stride, dst_seg_stride, imm)
        err[0] = 0
        self._enter()
        try:
            with nogil:
                rc = pdkv_core_queue(self.core, watch, value, conn, &b, tag, err)
        finally:
            self._busy -= 1
        if rc < 0:
            _raise(rc, err, "queue_pages")

    # ---- immediates ----

    def expect(self, uint32_t imm, uint64_t count):
        """Fire one imm_done event when `count` writes carrying `imm` have landed (earlier
        arrivals count). InvalidRequestError if imm is already expected or over-delivered."""
        cdef char err[PDKV_ERR_MAX]
        cdef int rc
        self._check()
        err[0] = 0
        rc = pdkv_core_expect(self.core, imm, count, err)
        if rc < 0:
            _raise(rc, err, "expect")

    def forget(self, uint32_t imm):
        """Drop imm's counter -> the writes it had counted (0 if it had none)."""
        cdef char err[PDKV_ERR_MAX]
        cdef int64_t rc
        self._check()
        rc = pdkv_core_forget(self.core, imm, err)
        return 0 if rc == -_errno.ENOENT else rc

    # ---- results ----

    def drain(self, int max_events=4096):
        """Reset fileno() and return up to max_events pending Events (possibly none)."""
        cdef pdkv_event *ev
        cdef int n, i
        self._check()
        if max_events <= 0:
            return []
        ev = <pdkv_event *>malloc(max_events * sizeof(pdkv_event))
        if ev == NULL:
            raise MemoryError()
        try:
            self._enter()
            try:
                with nogil:
                    n = pdkv_core_drain(self.core, ev, max_events)
            finally:
                self._busy -= 1
            out = []
            for i in range(n):
                out.append(Event(_KINDS.get(ev[i].kind, "error"), ev[i].tag, ev[i].imm, ev[i].peer,
                                 ev[i].count, ev[i].bytes, ev[i].num_errors, ev[i].status,
                                 ev[i].reason.decode("utf-8", "replace")))
            return out
        finally:
            free(ev)

    def stats(self):
        """Poller counters: polls, posted_batches, last_post_poll, writes_posted, writes_done,
        imms, sleeps, blocks, queued; and the transport's: refused_writes (remote writes refused
        before landing), refused_conns (incoming connections closed before they were accepted),
        pending_conns (incoming connections not yet authenticated), rx_threads (receive threads);
        shm: copied_writes / copied_bytes (writes that were a memcpy), shared_writes (no copy);
        verbs, libfabric: nics, what each NIC (libfabric: the fabric domain) carried (nic_stats())."""
        cdef pdkv_core_stats s
        cdef pdkv_transport_counters tc
        self._check()
        pdkv_core_get_stats(self.core, &s)
        memset(&tc, 0, sizeof(tc))
        if self.t.ops.counters != NULL:
            self.t.ops.counters(self.t, &tc)
        out = dict(s)
        out.update(tc)
        if self.t.ops.nic_stats != NULL:
            out["nics"] = self.nic_stats()
        return out

    def polls(self):
        """Poller iterations so far (cheap; never releases the GIL)."""
        cdef pdkv_core_stats s
        self._check()
        pdkv_core_get_stats(self.core, &s)
        return s.polls

    # ---- fault injection (fake transport only) ----

    def add_fault(self, str kind, uint64_t first, uint64_t count=1, uint32_t delay_us=0):
        """FAKE transport: apply `kind` (drop, delay, duplicate, corrupt, error, vanish) to the
        writes numbered [first, first+count) that this node posts (count 0: all later ones)."""
        cdef int rc
        self._check()
        if self.transport != "fake":
            raise InvalidRequestError(_errno.EINVAL, "faults exist only on the fake transport")
        if kind not in _FAULTS:
            raise InvalidRequestError(_errno.EINVAL, f"unknown fault {kind!r} (one of {sorted(_FAULTS)})")
        rc = pdkv_fake_add_fault(self.t, _FAULTS[kind], first, count, delay_us)
        if rc < 0:
            _raise(rc, self.t.ops.last_error(self.t), "add_fault")


include "_messenger_wire.pxi"
