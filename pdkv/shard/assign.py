"""Per-request choice of which source replica set feeds each destination replica set.

Both nodes must reach the same answer without talking, so the choice is a pure function of a
per-request seed, written with integer arithmetic only (splitmix64) so that C or another
language can compute it too; Python's ``random`` and ``hash()`` are not used because their
outputs are not a documented contract (``hash()`` is even salted per process).

NOTE: the destination sets take consecutive source sets from a random offset, rather than
independent draws. Each destination set's source is still uniform over the source sets, but
within one request two destination sets never share a source set while another one idles, so
the request's writes leave from as many NICs as there are sets to use.
"""

from __future__ import annotations

import hashlib

from pdkv.shard.spec import ShardPlanError

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One step of splitmix64 (Steele, Lea, Flood 2014): a 64-bit bijective mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_seed(request_id: str | bytes) -> int:
    """A 64-bit seed both sides derive from the request id (BLAKE2b, little-endian)."""
    if isinstance(request_id, str):
        request_id = request_id.encode()
    if not isinstance(request_id, bytes) or not request_id:
        raise ShardPlanError(f"request id must be a non-empty str or bytes, got {request_id!r}")
    return int.from_bytes(hashlib.blake2b(request_id, digest_size=8).digest(), "little")


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MASK64:
        raise ShardPlanError(f"request seed must be an integer in [0, 2**64), got {seed!r}")
    return seed


def assign_sources(num_src_sets: int, num_dst_sets: int, seed: int) -> tuple[int, ...]:
    """Source set index for each destination set: ``(offset + j) % num_src_sets``.

    offset = splitmix64(seed) % num_src_sets. Returns a tuple of length ``num_dst_sets``.
    """
    check_seed(seed)
    if num_src_sets < 1 or num_dst_sets < 1:
        raise ShardPlanError(
            f"replica set counts must be positive, got {num_src_sets} source, {num_dst_sets} destination"
        )
    offset = splitmix64(seed) % num_src_sets
    return tuple((offset + j) % num_src_sets for j in range(num_dst_sets))


def pick_nic(seed: int, rank: int, num_nics: int) -> int:
    """Which of source rank ``rank``'s ``num_nics`` NICs carries the request with ``seed``
    (a rank near several NICs spreads its requests over them; one NIC: always 0)."""
    check_seed(seed)
    if num_nics < 1 or rank < 0:
        raise ShardPlanError(f"need a rank >= 0 and at least one NIC, got rank {rank}, {num_nics} NICs")
    return splitmix64(seed ^ splitmix64(rank + 1)) % num_nics
