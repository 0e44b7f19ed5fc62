"""A consumer's commits: the offsets it processed, sent to each queue's group leader.

- :class:`Processed` (``_state``) is the next offset to commit per queue, and which queues moved
  since the last commit: a commit every interval looks at those only (not at 10,000
  queues), and sends one request per broker however many queues moved.
- Commits never overlap: an older commit of a queue must not land after a newer one.
- A periodic commit that fails leaves its offsets processed: they are committed next
  time. A released queue's last commit is tried once (following its group's leader for
  ``retry_budget_ms``); if it fails, the queue's next owner reads again from the offset
  committed before (at least once).
"""

from __future__ import annotations

import logging

import trio

from clmq.common import collector_paused
from clmq.protocol import RequestCode

from .._routes import MessageQueue
from ._requests import NET_ERRORS, Requests
from ._state import ConsumerState

log = logging.getLogger("clmq.consumer")


class Commits:
    """``state.processed`` (what to commit) and ``committed`` (what the leaders have)."""

    def __init__(self, state: ConsumerState, requests: Requests) -> None:
        self.state = state
        self.requests = requests
        self.committed: dict[MessageQueue, int] = {}
        self._lock = trio.Lock()

    async def commit_changed(self) -> None:
        """Commit every queue whose processed offset moved since the last commit."""
        async with self._lock:
            by_broker: dict[str, dict[MessageQueue, int]] = {}
            processed = self.state.processed
            changed, processed.changed = processed.changed, set()
            with collector_paused():  # an entry per queue moved: 65,536 for a sparse consumer
                for mq in changed:
                    offset = processed.get(mq)
                    if offset is not None and self.committed.get(mq) != offset:
                        by_broker.setdefault(mq.addr, {})[mq] = offset
            for addr, offsets in by_broker.items():  # one request per broker, however many queues
                await self._commit_to(addr, offsets)

    async def commit_queue(self, mq: MessageQueue, offset: int | None = None) -> None:
        """Commit ``offset`` of ``mq`` now (default: its processed offset), if it moved."""
        async with self._lock:
            if offset is None:
                offset = self.state.processed.get(mq)
            if offset is not None and self.committed.get(mq) != offset:
                await self._commit_to(mq.addr, {mq: offset})

    def forget(self, mq: MessageQueue) -> int | None:
        """``mq`` is no longer read here: its offsets go; returns its processed offset."""
        self.committed.pop(mq, None)
        return self.state.processed.pop(mq, None)

    async def _commit_to(self, addr: str, offsets: dict[MessageQueue, int]) -> None:
        """Commit to the group's leader (``to_leader``). Offsets not committed stay
        processed: committed later."""
        with collector_paused():
            rows = [[mq.topic, mq.queue_id, o] for mq, o in offsets.items()]
        fields = {"group": self.state.group, "offsets": rows}
        try:
            await self.requests.to_leader(next(iter(offsets)), addr, RequestCode.COMMIT_OFFSET, fields)
        except NET_ERRORS as e:
            log.warning("consumer %s: commit of %d offsets to %s failed: %s", self.state.client_id, len(rows), addr, e)
            self.state.processed.changed.update(offsets)  # committed next time
            return
        self.committed.update(offsets)
