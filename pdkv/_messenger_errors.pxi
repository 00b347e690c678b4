# Included by _messenger.pyx: the errno -> exception table and the Event record.

# ---- errors: one errno -> exception table ----

class MessengerError(OSError):
    """A messenger call failed; ``errno`` is the C code, ``strerror`` the reason."""

class InvalidRequestError(MessengerError, ValueError):
    """Bad arguments: out-of-range offset, unknown key, overflowing page index, ..."""

class RegionBusyError(MessengerError):
    """A region still has writes in flight or queued batches (-EBUSY)."""

class PeerConnectionError(MessengerError, ConnectionError):
    """The connection to the peer is down, refused or not complete."""

class TransportUnavailableError(MessengerError):
    """The transport cannot be created on this machine (no RDMA device, not built, bad NIC)."""

_ERRORS = {
    _errno.EINVAL: InvalidRequestError, _errno.ERANGE: InvalidRequestError,
    _errno.EOVERFLOW: InvalidRequestError, _errno.EEXIST: InvalidRequestError,
    _errno.ENOENT: InvalidRequestError, _errno.EACCES: InvalidRequestError,
    _errno.ENOSPC: InvalidRequestError, _errno.EISCONN: InvalidRequestError,
    _errno.EBUSY: RegionBusyError,
    _errno.ENOTCONN: PeerConnectionError, _errno.ECONNRESET: PeerConnectionError,
    _errno.ECONNREFUSED: PeerConnectionError, _errno.EPIPE: PeerConnectionError,
    _errno.EPROTO: PeerConnectionError, _errno.ETIMEDOUT: PeerConnectionError,
    _errno.EHOSTUNREACH: PeerConnectionError,
    _errno.ENODEV: TransportUnavailableError, _errno.ENOSYS: TransportUnavailableError,
}


cdef int _raise(int64_t rc, const char *reason, str what) except -1:
    code = int(-rc)
    msg = f"{what}: {reason.decode('utf-8', 'replace')}" if reason[0] else f"{what}: {os.strerror(code)}"
    if code == _errno.ENOMEM:
        raise MemoryError(msg)
    raise _ERRORS.get(code, MessengerError)(code, msg)


Event = namedtuple("Event", "kind tag imm peer count bytes num_errors status reason")
Event.__doc__ = """One result of the messenger.

kind: "batch_done" (every write of batch ``tag`` completed locally; ``num_errors`` failed),
"imm_done" (``count`` writes carrying ``imm`` landed here: once per expect()), or "error"
(a connection failed or more writes than expected arrived; ``reason`` says which).
status: 0 or a negative errno."""

_KINDS = {PDKV_EV_BATCH_DONE: "batch_done", PDKV_EV_IMM_DONE: "imm_done", PDKV_EV_ERROR: "error"}
# the numbers come from fake.h (enum pdkv_fake_fault_kind), never repeated here
_FAULTS = {"drop": PDKV_FAKE_DROP, "delay": PDKV_FAKE_DELAY, "duplicate": PDKV_FAKE_DUPLICATE,
           "corrupt": PDKV_FAKE_CORRUPT, "error": PDKV_FAKE_ERROR, "vanish": PDKV_FAKE_VANISH}
