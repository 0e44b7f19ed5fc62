"""Which of a consumer's queues its fetcher may ask about next, per broker: those whose
offset is known and that are in no request, in two lines (data and watch), next first,
so that picking costs what it takes, not a walk over 10,000 queues; and the events the
fetch loops wait on until a queue is ready."""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import trio

from clmq.common import collector_paused
from clmq.protocol import FetchResult, PullStatus

from .._routes import MessageQueue
from ._state import ConsumerState, QueueState

MIN_FETCH_QUEUES = 16  # a request covers at least this many queues (when it has them)

Picked = list[tuple[MessageQueue, QueueState]]


class ReadyQueues:
    """Queues ready to be asked about, per (broker, idle); ``idle``: watched (long
    polled) rather than fetched."""

    def __init__(self, state: ConsumerState) -> None:
        self.state = state
        self.options = state.options
        self._ready: defaultdict[tuple[str, bool], OrderedDict[MessageQueue, QueueState]] = defaultdict(OrderedDict)
        self._wakeups: dict[tuple[str, bool], trio.Event] = {}  # (broker, idle)
        self._density: dict[str, float] = {}  # per broker: messages per queue visited, recently

    def put(self, mq: MessageQueue, st: QueueState, idle: bool | None = None) -> None:
        """``mq`` is ready (in the line ``st.idle`` says, unless ``idle`` is given)."""
        self._ready[(mq.addr, st.idle if idle is None else idle)][mq] = st

    def wake(self, addr: str) -> None:
        """Wake the fetch loops of broker ``addr``: queues may be ready."""
        for idle in (False, True):
            event = self._wakeups.get((addr, idle))
            if event is not None:
                event.set()

    def waiter(self, addr: str, idle: bool) -> trio.Event:
        """The event :meth:`wake` sets next (taken before picking: no lost wake-up)."""
        self._wakeups[(addr, idle)] = event = trio.Event()
        return event

    def pick(self, addr: str, idle: bool) -> Picked:
        """The next queues to fetch (``idle``: to watch). A data request takes at most a
        share of the broker's queues, so that ``fetches_in_flight`` requests cover
        disjoint sets and overlap (the broker reads one while the client decodes
        another) instead of one request taking them all."""
        cap = self.options.fetch_queues
        assigned = self.state.assigned
        if not idle:
            share = -(-len(assigned) // self.options.fetches_in_flight)  # all brokers': a cap, not a quota
            cap = min(cap, max(MIN_FETCH_QUEUES, share))
            density = self._density.get(addr, 0.0)
            if density > 0:  # ask about as many queues as the answer can hold messages of (twice, for the skew)
                cap = min(cap, max(MIN_FETCH_QUEUES, int(2 * self.options.fetch_max_messages / density)))
        ready = self._ready[(addr, idle)]
        picked: Picked = []
        while ready and len(picked) < cap:
            mq, st = ready.popitem(last=False)
            if assigned.get(mq) is st and not st.stopped:  # else given up or stopped meanwhile: forget it
                picked.append((mq, st))
        return picked

    def put_back(self, picked: Picked, skipped: set[MessageQueue] | None) -> None:
        """Queues an answer read go to the back of their line (idle or not, as it said);
        those it did not reach (``skipped``; None: all, the request failed) keep their
        place in front."""
        assigned = self.state.assigned
        if skipped is None:
            skipped = {mq for mq, _st in picked}
        with collector_paused():
            for mq, st in reversed(picked):
                if mq in skipped and assigned.get(mq) is st:
                    ready = self._ready[(mq.addr, st.idle)]
                    ready[mq] = st
                    ready.move_to_end(mq, last=False)
            for mq, st in picked:
                if mq not in skipped and assigned.get(mq) is st and not st.paused and not st.stopped:
                    self._ready[(mq.addr, st.idle)][mq] = st

    def learn(self, addr: str, results: list[FetchResult], found: int) -> None:
        """Messages per queue the broker got to in data answers (an average over recent
        ones). Asking many more queues than an answer can fill makes both sides walk
        asks that come back SKIPPED."""
        visited = sum(1 for r in results if r.status is not PullStatus.SKIPPED)
        if visited:
            sample = found / visited
            self._density[addr] = 0.7 * self._density.get(addr, sample) + 0.3 * sample
