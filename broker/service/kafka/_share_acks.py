"""A share member's acknowledgements of one partition (carried by ShareFetch and
ShareAcknowledge) applied to the POP state.

Each batch names offsets ``first..last`` with one type for all or one per offset:
GAP (0, no record there: nothing to do), ACCEPT (1) -> ``PopService.ack``, RELEASE (2)
-> ``change_invisible_time(0)`` (visible again; the next delivery counts one more),
REJECT (3) -> ``reject`` (to ``%DLQ%group`` now), RENEW (4, v2) -> the lock restarted
for ``kafka_share_record_lock_duration_ms``. An offset this member does not hold (never
given, settled, redelivered to someone else, or its lock run out) is refused: the
partition answers INVALID_RECORD_STATE naming the first such offsets, and the others
are applied. A malformed batch (last before first, types not 1 or one per offset, an
unknown type, more offsets than a member can hold) is INVALID_REQUEST and applies
nothing of that partition. While the POP state is not running here (starting,
recovering, not the leader) the POP service's RequestError is raised before anything
is judged (``_share_errors`` maps it to a code the client retries or reports).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clmq.protocol.kafka import ErrorCode
from clmq.protocol.transport import RequestError

from ._share_errors import ack_error
from ._share_sessions import PopLike, ShareSession

GAP, ACCEPT, RELEASE, REJECT, RENEW = 0, 1, 2, 3, 4
NAMED_OFFSETS_MAX = 8  # refused offsets named in an error message


@dataclass
class AckOutcome:
    """What one partition's acknowledgements came to."""

    code: int = ErrorCode.NONE
    message: str | None = None
    applied: int = 0
    refused: list[int] = field(default_factory=list)


def _planned(batches: list[dict[str, Any]], max_offsets: int) -> list[tuple[int, int]] | str:
    """(offset, type) of every non-gap offset, or why the batches are malformed."""
    out: list[tuple[int, int]] = []
    for b in batches:
        first, last, types = b["first_offset"], b["last_offset"], list(b["acknowledge_types"])
        span = last - first + 1
        if first < 0 or span < 1 or span > max_offsets:
            return f"batch {first}..{last}: offsets must be 0 <= first <= last, at most {max_offsets}"
        if len(types) not in (1, span) or any(t not in (GAP, ACCEPT, RELEASE, REJECT, RENEW) for t in types):
            return f"batch {first}..{last}: types must be one or one per offset, each 0..4, got {types[:8]}"
        out.extend((first + i, types[0] if len(types) == 1 else types[i]) for i in range(span))
    return [(offset, kind) for offset, kind in out if kind != GAP]


async def apply_acks(
    pop: PopLike,
    session: ShareSession,
    topic: str,
    queue_id: int,
    batches: list[dict[str, Any]],
    limits: tuple[int, int],
) -> AckOutcome:
    """One partition's batches applied for ``session``'s member; ``limits`` is (the most
    offsets one request may name, the lock duration in ms a RENEW restarts)."""
    max_offsets, lock_ms = limits
    plan = _planned(batches, max_offsets)
    if isinstance(plan, str):
        return AckOutcome(ErrorCode.INVALID_REQUEST, plan)
    pop.running_state()  # a state not loaded yet knows no delivery: RequestError, not "not held"
    out = AckOutcome()
    by_kind: dict[int, list[tuple[int, str]]] = {}
    for offset, kind in plan:
        d = pop.delivery_of(session.group, topic, queue_id, offset)
        if d is None or pop.owner_of(session.group, d.handle) != session.member:
            out.refused.append(offset)
            continue
        by_kind.setdefault(kind, []).append((offset, d.handle))
    for kind, rows in by_kind.items():
        try:
            await _settle(pop, session, (topic, queue_id), kind, rows, lock_ms, out)
        except RequestError as e:
            if not out.applied:
                raise  # nothing of the partition known applied: the caller answers the error
            out.code = ack_error(e.code.name)  # (one code a partition: the message says what was applied)
            out.message = f"{out.applied} applied, then type {kind} for {len(rows)} offsets failed: {e.text}"
            return out
    if out.refused:
        named = ", ".join(map(str, sorted(out.refused)[:NAMED_OFFSETS_MAX]))
        out.code = ErrorCode.INVALID_RECORD_STATE
        out.message = f"{len(out.refused)} offsets not held by member {session.member}: {named}"
    return out


async def _settle(
    pop: PopLike,
    session: ShareSession,
    queue: tuple[str, int],
    kind: int,
    rows: list[tuple[int, str]],
    lock_ms: int,
    out: AckOutcome,
) -> None:
    """One kind of acknowledgement of ``rows`` (offset, handle) through the POP service."""
    group, handles = session.group, [h for _, h in rows]
    renewed: list[str] = []
    if kind == ACCEPT:
        statuses = await pop.ack(group, handles)
    elif kind == REJECT:
        statuses = await pop.reject(group, handles)
    else:
        changed = await pop.change_invisible_time(group, handles, 0 if kind == RELEASE else lock_ms)
        statuses, renewed = [s for s, _ in changed], [h for _, h in changed]
    for i, ((offset, _), status) in enumerate(zip(rows, statuses)):
        key = (queue[0], queue[1], offset)
        if status != "ok":
            out.refused.append(offset)
            continue
        out.applied += 1
        if kind == RENEW and renewed[i]:
            session.held[key] = renewed[i]
        else:
            session.held.pop(key, None)
