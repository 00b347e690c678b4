"""What one disaggregated request holds on the decode node, and its one way back.

A :class:`Reservation` is made when the decode connector admits a request with remote KV
(engine thread: its hidden-state row, with staging its landing slots; the engine holds its
pages) and gets the request's grants on the event loop, once the grant thread made them. Every
way the request can end — its KV landed, the client left, FAIL, the transfer timed out, the
peer died, no peer or too many grants, the grants could not be made, the node stops — ends in
``release``, exactly once (a second call is a no-op and returns False):

1. revoke the grants (a range a write is landing in right now is retried shortly: the pages
   and the row go to nobody while a write of this request can still land);
2. give the hidden row back, and the landing slots unless they are being copied into the pages
   (``landed``: the copy-in gives them back);
3. ``pages``: tell the engine it may reuse the request's pages (ReleasePages); then ``then``.

A prefill node that died mid-transfer (its data connection torn down: none of its writes lands
any more) does not end the request: ``reset`` revokes that node's grants and keeps the row, the
landing slots and the pages for another prefill node, which is granted them afresh and rewrites
every one of them (a new immediate: a late count of the dead node's writes finds no counter). A
``release`` while the revocation is retried waits for it, then gives everything back.

The speculative hand-off's proposer pages are not held here: the proposer takes them at its
first draft, or they go back at the connector's ``released`` (after ReleasePages).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdkv.engine.loop import ReleasePages

REVOKE_RETRY_S = 0.002  # a range a write is landing in right now: try again this much later


@dataclass(eq=False)
class Reservation:
    rid: str
    row: int  # its hidden-state row
    memory: object  # pdkv.disagg.decode_memory.DecodeMemory: the pools it came from
    grantee: int = 0  # the prefill node the grants were made to
    grants: tuple = ()  # pdkv.disagg.grants.Range: what that node may write now
    landed: bool = False  # staged: the landing slots are being copied in (the copy gives them back)
    releases: int = field(default=0, repr=False)  # calls of release, the first one counts (tests read it)
    resets: int = 0  # prefill nodes that died holding its grants (disagg.prefill_retries bounds them)
    _resetting: bool = field(default=False, repr=False)  # a reset's revocation is being retried
    _after_reset: tuple | None = field(default=None, repr=False)  # (pages, then) of a release meanwhile

    @property
    def released(self) -> bool:
        return self.releases > 0

    def granted(self, grantee: int, ranges: tuple) -> None:
        """The grant thread made ``ranges`` for ``grantee``. Released meanwhile (the node is
        stopping): they are revoked at once, nothing else goes back twice."""
        self.grantee, self.grants = grantee, tuple(ranges)
        if self.released:
            self.memory.grants.revoke(grantee, list(ranges))  # NOTE: a busy one goes with the messenger
            self.memory.hold(grantee, -len(ranges))
            self.grants = ()

    def release(self, pages: bool, then: Callable[[], None] | None = None) -> bool:
        """The request is over here and no write of it can land once the grants are gone: give
        everything back (see the module docstring). False: it was released already."""
        self.releases += 1
        if self.releases > 1:
            return False
        if self._resetting:  # NOTE: the reset's revocation is still running: it finishes this release
            self._after_reset = (pages, then)
            return True
        self._revoke(list(self.grants), pages, then)
        return True

    def reset(self, then: Callable[[], None]) -> bool:
        """The prefill node holding the grants is gone and none of its writes can land any more:
        revoke its grants, keep everything else for another node, then ``then`` (which grants
        and sends again, or releases). False: released already, nothing happens."""
        if self.released or self._resetting:
            return False
        self.resets += 1
        self._resetting = True
        self._revoke(list(self.grants), False, then, keep=True)
        return True

    def _revoke(self, ranges: list, pages: bool, then, keep: bool = False) -> None:
        mem = self.memory
        busy = mem.grants.revoke(self.grantee, ranges) if ranges else []
        if busy:
            mem.later(REVOKE_RETRY_S, self._revoke, busy, pages, then, keep)
            return
        if self.grants:
            mem.hold(self.grantee, -len(self.grants))
        self.grants = ()
        if keep:
            self._resetting = False
            if self._after_reset is None:
                then()
                return
            (pages, then), self._after_reset = self._after_reset, None  # released meanwhile
        mem.live.pop(self.rid, None)
        # NOTE: the row goes back before ReleasePages / ``then``, which make the engine retry admission
        mem.rows.give_back(self.row)
        if mem.landing is not None and not self.landed:
            mem.landing.release(self.rid)  # no write can land: the landing slots go back uncopied
        if pages:
            mem.commands(ReleasePages(self.rid))
        if then is not None:
            then()
