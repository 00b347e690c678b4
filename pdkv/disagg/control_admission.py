"""Who may hold one of the prefill node's control connections: two budgets, one for connections
still handshaking and one for established links, so that strangers can never take a link's place.

- **Handshaking** (``messenger.max_handshakes``, ``max_control_per_source`` of them per source
  address): from accept until the handshake (TLS, authentication, HELLO) finished. A source at
  its cap has its newest connection refused. With the budget full, a newcomer takes the place of
  the *victim*: the oldest connection of the source holding the most. The victim goes when that
  makes the budget fairer (the newcomer's source would still hold fewer than the victim's) or when
  it has been held ``EVICT_AFTER_S`` already (an honest handshake takes a few round trips): a flood
  from a few addresses displaces only itself, and one from many cannot keep a slot longer than
  that nor churn faster than the budget per ``EVICT_AFTER_S``. Else the newcomer is refused.
- **Established** (``messenger.max_control_conns``, ``max_control_per_source`` per source): a
  connection that finished its handshake is no longer evictable (the peer proved the secret; a
  data-path set-up may be running for it) and moves here at ``establish``; a full budget refuses
  the newcomer, never a link.
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field
from typing import Callable

EVICT_AFTER_S = 1.0  # a handshaking connection held this long may give its place to a newcomer


class Place(enum.Enum):
    """HANDSHAKING -> ESTABLISHED -> GONE; HANDSHAKING -> GONE (evicted, refused or ended)."""
    HANDSHAKING = 1
    ESTABLISHED = 2
    GONE = 3


@dataclass(eq=False)
class Ticket:
    """One accepted connection's place; ``close()`` ends the connection (used when evicted)."""

    source: str
    close: Callable[[], None]
    since: float = field(default_factory=time.monotonic)
    state: Place = Place.HANDSHAKING


class ControlAdmission:
    def __init__(self, max_handshakes: int, max_links: int, max_per_source: int,
                 evict_after_s: float = EVICT_AFTER_S):
        self.max_handshakes, self.max_links, self.max_per_source = max_handshakes, max_links, max_per_source
        self.evict_after_s = evict_after_s
        self._handshaking: dict[Ticket, None] = {}  # insertion order: oldest first
        self._hs_by_source: collections.Counter = collections.Counter()
        self._links_by_source: collections.Counter = collections.Counter()
        self.num_evicted = 0
        self.num_refused = 0

    @property
    def num_handshaking(self) -> int:
        return len(self._handshaking)

    @property
    def num_links(self) -> int:
        return sum(self._links_by_source.values())

    def admit(self, source: str, close: Callable[[], None], now: float | None = None) -> Ticket | str:
        """A place for a new connection from ``source``, or the reason it is refused."""
        now = time.monotonic() if now is None else now
        if self._hs_by_source[source] >= self.max_per_source:
            return self._refuse(f"{self._hs_by_source[source]} handshaking connections from {source} "
                                f"(messenger.max_control_per_source {self.max_per_source})")
        if len(self._handshaking) >= self.max_handshakes:
            victim = self._victim()
            fairer = self._hs_by_source[source] + 1 < self._hs_by_source[victim.source]
            if not fairer and now - victim.since < self.evict_after_s:
                return self._refuse(f"{len(self._handshaking)} connections handshaking, none held "
                                    f"{self.evict_after_s} s (messenger.max_handshakes {self.max_handshakes})")
            self._drop(victim)
            self.num_evicted += 1
            victim.close()
        t = Ticket(source, close, now)
        self._handshaking[t] = None
        self._hs_by_source[source] += 1
        return t

    def establish(self, t: Ticket) -> str | None:
        """The handshake of ``t`` finished: it leaves the handshaking budget for the links' (None),
        or the reason the links' budget refuses it (then it holds nothing)."""
        if t.state is not Place.HANDSHAKING:
            return "the connection was closed while handshaking"
        self._drop(t)
        if self.num_links >= self.max_links:
            self.num_refused += 1
            return f"{self.num_links} links held (messenger.max_control_conns {self.max_links})"
        if self._links_by_source[t.source] >= self.max_per_source:
            self.num_refused += 1
            return (f"{self._links_by_source[t.source]} links held from {t.source} "
                    f"(messenger.max_control_per_source {self.max_per_source})")
        t.state = Place.ESTABLISHED
        self._links_by_source[t.source] += 1
        return None

    def release(self, t: Ticket) -> None:
        """The connection ended (idempotent)."""
        if t.state is Place.ESTABLISHED:
            self._links_by_source[t.source] -= 1
            if self._links_by_source[t.source] <= 0:
                del self._links_by_source[t.source]
            t.state = Place.GONE
        elif t.state is Place.HANDSHAKING:
            self._drop(t)

    def _victim(self) -> Ticket:
        most = max(self._hs_by_source.values())
        return next(t for t in self._handshaking if self._hs_by_source[t.source] == most)

    def _drop(self, t: Ticket) -> None:
        del self._handshaking[t]
        self._hs_by_source[t.source] -= 1
        if self._hs_by_source[t.source] <= 0:
            del self._hs_by_source[t.source]
        t.state = Place.GONE

    def _refuse(self, reason: str) -> str:
        self.num_refused += 1
        return reason
