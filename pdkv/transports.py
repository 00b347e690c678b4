"""The transports' Python side: each transport's options (one frozen dataclass per transport, what
``Messenger(transport, node_id, options)`` takes) and the capabilities it declares.

The C table in ``pdkv/csrc/transports.c`` is what makes a transport (name -> constructor taking
that transport's options struct, plus its capabilities); the classes here mirror its rows, so
that config validation and staging can ask what a transport *can do* without loading the
compiled extension (``tests/messenger/test_c_graph.py`` checks that both say the same, and
``Messenger.capabilities`` reads the C row at run time). Code above the messenger asks
``capabilities(name)`` instead of comparing transport names, or ``capabilities(name, ms)`` with
the messenger config when what the transport can do depends on it: libfabric's provider (its
C row declares what every provider offers; ``efa`` adds GPUDIRECT through FI_HMEM, ``shm``
reaches this host only).

A new transport (docs/TRANSPORTS.md) adds one options class here, registered with
``@transport("name", caps)``, and its row in transports.c.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar


class Capability(enum.Flag):
    """What a transport can do; the C row's ``PDKV_CAP_*`` bits, in the same order."""

    NONE = 0
    HOST_MEMORY = 1  # writes from and into registered host memory (every transport)
    DEVICE_MEMORY = 2  # can register device (GPU) memory itself: GPU KV need not be staged
    SAME_HOST_ONLY = 4  # both ends must be processes of one host (shared memory, CUDA IPC)
    PEER_ISOLATION = 8  # grants per peer: a peer writes only what it was granted, until revoked
    GPUDIRECT = 16  # device memory reached by the NIC's DMA (dma-buf / peer memory)
    SEALED_STREAMS = 32  # the data path itself can be encrypted and authenticated (tls_data)
    # grant / revoke are entries in the receiver's own table (no memory registration, no round
    # trip to the peer): the decode node makes them on its event loop, not in its grant thread
    INSTANT_GRANTS = 64


# C bit names, for messages and for the check that the C table says the same
CAP_NAMES = {c: c.name.lower() for c in Capability if c.name and c is not Capability.NONE}

OPTIONS: dict[str, type] = {}  # transport name -> its options class, in registration order


def transport(name: str, caps: Capability):
    """Register an options class as transport ``name``'s, declaring its capabilities."""

    def register(cls):
        cls.name, cls.capabilities = name, caps
        OPTIONS[name] = cls
        return cls

    return register


def options_class(name: str) -> type:
    """The options class of transport ``name``; ValueError naming the known ones otherwise."""
    try:
        return OPTIONS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r} (expected one of {', '.join(OPTIONS)})") from None


def capabilities(name: str, ms=None) -> Capability:
    """What transport ``name`` can do (ValueError for an unknown name); with ``ms`` (a
    MessengerConfig) what it can do as that config makes it (its options class's
    ``config_capabilities``, e.g. per libfabric provider), else what every such transport can."""
    cls = options_class(name)
    per_config = getattr(cls, "config_capabilities", None)
    return per_config(ms) if ms is not None and per_config else cls.capabilities


def names_with(cap: Capability) -> list[str]:
    """Config transports that have every capability in ``cap`` (for error messages: "use one of ...")."""
    return [n for n, c in OPTIONS.items() if c.in_config and cap in c.capabilities]


def config_names() -> tuple[str, ...]:
    """The transports a node config may name (messenger.transport)."""
    return tuple(n for n, c in OPTIONS.items() if c.in_config)


@transport("tcp", Capability.HOST_MEMORY | Capability.PEER_ISOLATION | Capability.SEALED_STREAMS
           | Capability.INSTANT_GRANTS)
@dataclass(frozen=True)
class TcpOptions:
    """tcp: page writes over ``num_streams`` TCP connections per peer.

    handshake_ms: an incoming stream that has not sent a valid hello by then is closed;
    max_pending: such streams waiting at once (more are closed at accept); max_per_source: of
    them from one IP address, 0: a quarter of max_pending. None of them gets a thread."""

    name: ClassVar[str]
    capabilities: ClassVar[Capability]
    in_config: ClassVar[bool] = True  # a messenger.transport a config may name (fake: tests only)
    probe_rdma: ClassVar[bool] = False  # drives ibverbs devices: `pdkv probe` checks them at start
    host: str = "127.0.0.1"
    port: int = 0
    num_streams: int = 2
    handshake_ms: int = 5000
    max_pending: int = 64
    max_per_source: int = 0

    @classmethod
    def from_config(cls, ms, where) -> TcpOptions:
        # unauthenticated data streams waiting for their hello: bounded per source address too
        return cls(host=ms.host, port=ms.port, num_streams=ms.num_streams,
                   max_per_source=ms.max_control_per_source)

    @staticmethod
    def listeners(ms) -> dict[str, str]:
        """Config keys naming addresses this transport listens on (checked at node start)."""
        return {"messenger.host": ms.host}


@transport("verbs", Capability.HOST_MEMORY | Capability.DEVICE_MEMORY | Capability.PEER_ISOLATION
           | Capability.GPUDIRECT)
@dataclass(frozen=True)
class VerbsOptions:
    """verbs (ibverbs RC, WRITE_WITH_IMM) over ``nics`` (device names; "auto" is resolved by
    pdkv.messenger before the transport is made). isolate_peers: a protection domain per peer,
    so the NIC enforces grants; without it a region's key lets any connected peer write all of
    it. remote_nics: queue-pair pairs toward this many peer NICs (0: as many as ours)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capability]
    in_config: ClassVar[bool] = True
    probe_rdma: ClassVar[bool] = True
    nics: tuple[str, ...] = ()
    port_num: int = 1
    gid_index: int = -1
    qps_per_peer: int = 1
    isolate_peers: bool = False
    remote_nics: int = 0

    @classmethod
    def from_config(cls, ms, where) -> VerbsOptions:
        # a protection domain per peer: only a connected, granted peer can write (pdkv/disagg/grants.py)
        return cls(nics=tuple(where.nics), isolate_peers=True, remote_nics=ms.remote_nics)

    @staticmethod
    def listeners(ms) -> dict[str, str]:
        return {}


@transport("libfabric", Capability.HOST_MEMORY | Capability.PEER_ISOLATION)
@dataclass(frozen=True)
class LibfabricOptions:
    """libfabric RDM endpoints (provider "efa", "tcp;ofi_rxm", "sockets", "shm" or "auto"; domains:
    fabric domain names, () for the provider's first; a fabric domain per peer enforces grants).
    table_keys: the provider-key path EFA takes, on a provider that lets us choose keys (tests).
    device_memory: ask the provider for FI_HMEM, so that register_device takes GPU memory (EFA);
    off by default: FI_HMEM changes some providers' protocols (shm's 64 KiB writes ~10x slower
    here), and the node stages GPU KV on libfabric. hmem_system: register_device takes host
    memory through the FI_HMEM calls (iface FI_HMEM_SYSTEM): the CPU stand-in for GPU memory on
    a provider with FI_HMEM (tests; implies device_memory)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capability]
    in_config: ClassVar[bool] = True
    probe_rdma: ClassVar[bool] = False  # EFA devices are not ibverbs RC devices: fi_getinfo checks them
    provider: str = "auto"
    domains: tuple[str, ...] = ()
    table_keys: bool = False
    device_memory: bool = False
    hmem_system: bool = False

    # what a provider adds to (or, for a same-host one, says about) the row every provider has:
    # efa registers GPU memory with the device (FI_HMEM + FI_MR_HMEM, dma-buf), which the node
    # then asks for (device_memory); shm moves memory between processes of one host. "auto" may
    # pick any provider, so it is promised nothing beyond the row.
    PROVIDER_CAPS: ClassVar[dict[str, Capability]] = {
        "efa": Capability.DEVICE_MEMORY | Capability.GPUDIRECT,
        "shm": Capability.SAME_HOST_ONLY,
    }

    @classmethod
    def config_capabilities(cls, ms) -> Capability:
        """What this transport can do with ``ms.libfabric.provider``."""
        return cls.capabilities | cls.PROVIDER_CAPS.get(ms.libfabric.provider, Capability.NONE)

    @classmethod
    def from_config(cls, ms, where) -> LibfabricOptions:
        # a fabric domain per peer, always (csrc/fabric.c): grants are MRs in the peer's own domain;
        # device memory exactly where the provider declares GPUDIRECT (the node registers GPU KV)
        gpu = Capability.GPUDIRECT in cls.config_capabilities(ms)
        return cls(provider=ms.libfabric.provider, domains=tuple(where.nics), device_memory=gpu)

    @staticmethod
    def listeners(ms) -> dict[str, str]:
        return {}


@transport("fake", Capability.HOST_MEMORY | Capability.PEER_ISOLATION | Capability.SAME_HOST_ONLY
           | Capability.INSTANT_GRANTS)
@dataclass(frozen=True)
class FakeOptions:
    """fake: in-process (memcpy between messengers of one process), with fault injection for tests."""

    name: ClassVar[str]
    capabilities: ClassVar[Capability]
    in_config: ClassVar[bool] = False  # in-process only: no node config can use it
    probe_rdma: ClassVar[bool] = False

    @classmethod
    def from_config(cls, ms, where) -> FakeOptions:
        return cls()

    @staticmethod
    def listeners(ms) -> dict[str, str]:
        return {}


@transport("shm", Capability.HOST_MEMORY | Capability.SAME_HOST_ONLY)
@dataclass(frozen=True)
class ShmOptions:
    """shm: both nodes on one host (csrc/shm.c). The receiver's registered memory is moved onto an
    unnamed file in ``dir``; a grant maps just the granted, page-rounded range into the writer and
    a revoke unmaps it; writes are memcpy's. Not PEER_ISOLATION: the writer holds the whole file's
    descriptor, so grants bound what a correct or buggy peer touches, not a hostile process of the
    same user (which could ptrace the other anyway)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capability]
    in_config: ClassVar[bool] = True
    probe_rdma: ClassVar[bool] = False
    dir: str = "/dev/shm"
    fault_host_id: str = ""  # fault injection (tests): the boot id our connection info claims
    fault_fail_maps: int = 0  # fault injection (tests): the next N grants peers send fail to map
    preallocate: bool = True  # a region's file allocated whole at registration (messenger.shm_preallocate)

    @classmethod
    def from_config(cls, ms, where) -> ShmOptions:
        return cls(dir=ms.shm_dir, fault_host_id=ms.fault_shm_host_id, fault_fail_maps=ms.fault_shm_fail_maps,
                   preallocate=ms.shm_preallocate)

    @staticmethod
    def listeners(ms) -> dict[str, str]:
        return {}


@transport("auto", Capability.HOST_MEMORY)
@dataclass(frozen=True)
class AutoOptions:
    """auto (csrc/auto.c): shm to a peer whose HELLO names this host (and whose shm connection
    then passes its own checks: boot id, the peer's socket reachable), tcp to every other peer
    and as the fallback. Only what both can do is declared: tcp's isolation and sealed streams
    do not hold for an shm peer. Over RDMA between hosts, name verbs or libfabric instead."""

    name: ClassVar[str]
    capabilities: ClassVar[Capability]
    in_config: ClassVar[bool] = True
    probe_rdma: ClassVar[bool] = False
    tcp: TcpOptions = TcpOptions()
    dir: str = "/dev/shm"
    fault_host_id: str = ""  # fault injection, as ShmOptions'
    fault_fail_maps: int = 0
    preallocate: bool = True  # as ShmOptions'

    @classmethod
    def from_config(cls, ms, where) -> AutoOptions:
        shm = ShmOptions.from_config(ms, where)
        return cls(tcp=TcpOptions.from_config(ms, where), dir=shm.dir, fault_host_id=shm.fault_host_id,
                   fault_fail_maps=shm.fault_fail_maps, preallocate=shm.preallocate)

    @staticmethod
    def listeners(ms) -> dict[str, str]:
        return TcpOptions.listeners(ms)
