"""A remote request's slot on the decode node: its immediate, its grants, and its state.

A slot's state machine::

    SENT ──count complete──► LANDED (the engine owns the pages now)
      │
      ├──timeout / client gone──► CANCELLING ──CANCEL_ACK / FAIL / DONE_AT{posted}──► DRAINING
      └──FAIL{posted}─────────────────────────────────────────────────────────────► DRAINING
    DRAINING ──exactly ``posted`` writes landed (at once if they already had)──► RELEASED
    CANCELLING / DRAINING ──no answer / not every posted write within messenger.lease_s of the
      request's end──► RELEASED (its grants revoked first: the peer's later writes are refused)
    (a dead peer: every slot RELEASED at once, after its data connection was torn down; a SENT
      one's Reservation is reset instead of released, and a new slot, with a new immediate, takes
      its PREFILL to another prefill node: disagg.prefill_retries)

Every transition is made by the decode coordinator (pdkv/disagg/decode.py) on the event loop;
RELEASED (and LANDED, for what the engine does not take over) is the slot's Reservation's one
``release`` (pdkv/disagg/reservation.py).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from pdkv.disagg.peers import Peer
from pdkv.disagg.reservation import Reservation


class SlotState(enum.Enum):
    SENT = "sent"
    LANDED = "landed"
    CANCELLING = "cancelling"
    DRAINING = "draining"
    RELEASED = "released"


@dataclass(eq=False)
class Slot:
    """A request's transfer: what it waits for. What it holds is its Reservation's."""

    imm: int
    res: Reservation  # the hidden row, landing slots, grants and pages: one release ends them
    peer: Peer
    num_pages: int
    expected: int
    t_sent: float
    state: SlotState = SlotState.SENT
    all_landed: bool = False  # the count fired (then the messenger dropped the counter)
    nbytes: int = 0  # what the expected writes carry
    timer: asyncio.TimerHandle | None = None
    skip: int = 0  # leading prompt pages this node held already (not sent, not granted)
    # echo + logprobs (pdkv/disagg/prompt_logprobs.py): the top alternatives asked (None: not
    # asked), the whole prompt they score, what PROMPT_LOGPROBS brought (None: not yet), and
    # whether the KV landed while they had not come yet (the decode waits for both)
    want_logprobs: int | None = None
    prompt: tuple = ()
    logprobs: list | None = None
    kv_landed: bool = False
    kv_pages: tuple = ()  # the request's KV pages (staged: its landing slots are copied into them)
    # what its PREFILL was sent with, to send it again to another node: (tokens, cached, ask)
    job: tuple = ()

    @property
    def rid(self) -> str:
        return self.res.rid

    @property
    def hidden_row(self) -> int:
        return self.res.row

    @property
    def grants(self) -> tuple:
        """What the peer may write for it now (its reservation's; () once revoked)."""
        return self.res.grants
