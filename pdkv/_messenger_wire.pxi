# Included by _messenger.pyx: the tcp wire format as Python helpers (tests, fuzzing, tools).

# ---- tcp wire helpers (tests, fuzzing and tools speak the real format through these) ----

_FRAME_TYPES = {"data": 1, "error": 2, "bye": 3, "ack": 4}


def tcp_frame(uint64_t key, uint64_t off, uint64_t length, imm=None, str type="data"):
    """The 40-byte header of a tcp frame, exactly as a sender emits it."""
    cdef c_tcp_frame f
    tcp_frame_make(&f, _FRAME_TYPES[type], key, off, length, imm or 0, imm is not None)
    return (<char *>&f)[:sizeof(c_tcp_frame)]


def tcp_parse_frame(bytes raw):
    """Parse 40 header bytes as a receiver does -> dict; InvalidRequestError with the reason."""
    cdef c_tcp_frame f
    cdef char why[160]
    if len(raw) != sizeof(c_tcp_frame):
        raise InvalidRequestError(_errno.EINVAL, f"a frame header is {sizeof(c_tcp_frame)} bytes, got {len(raw)}")
    if tcp_frame_parse(<const char *>raw, &f, why, sizeof(why)) < 0:
        raise InvalidRequestError(_errno.EPROTO, why.decode())
    return {"type": f.type, "flags": f.flags, "imm": f.imm, "key": f.key, "off": f.off, "len": f.len}


def tcp_hello(uint64_t node_id, bytes token, uint32_t stream=0, uint32_t num_streams=1):
    """The hello a writer sends first on a new stream (token: up to 32 bytes, zero-padded)."""
    cdef c_tcp_hello h
    if len(token) > TCP_TOKEN_LEN:
        raise InvalidRequestError(_errno.EINVAL, f"a token is at most {TCP_TOKEN_LEN} bytes, got {len(token)}")
    memset(&h, 0, sizeof(h))
    h.magic = TCP_HELLO_MAGIC
    h.version = TCP_VERSION
    h.node_id = node_id
    memcpy(h.token, <const char *>token, len(token))
    h.stream = stream
    h.num_streams = num_streams
    return (<char *>&h)[:sizeof(c_tcp_hello)]


def tcp_decode_info(bytes info):
    """A tcp connection-info blob -> dict(node_id, token (32 bytes), host, port)."""
    cdef tcp_conninfo ci
    if len(info) != sizeof(tcp_conninfo):
        raise InvalidRequestError(_errno.EINVAL, "not tcp connection info")
    memcpy(&ci, <const char *>info, sizeof(ci))
    ci.host[63] = 0
    return {"node_id": ci.node_id, "token": (<char *>ci.token)[:TCP_TOKEN_LEN], "host": ci.host.decode(),
            "port": ci.port}
