"""The timer's wheel: scheduled messages by the second they are due, with a constant,
small memory cost per message.

The messages themselves stay in the CommitLog (topic ``%TIMER%``, queue 0); the
wheel holds only their *queue offsets*: one slot per second of a window as long as
the longest delay allowed, each slot the head of a list threaded through ``links``
(``links[q]``: the previous offset of the same slot, or -1), RocketMQ 5's timer wheel
with its timer log replaced by the queue's own entries. So a pending message costs
8 bytes (its link), and the slots a fixed 8 bytes per second of the window, however
many messages are pending. Links are kept in pages of ``PAGE_ENTRIES`` offsets;
a page goes once none of its messages is pending, so a long-delayed message keeps
its page (512 KiB at most) and nothing more.

Plain data, no I/O and no locks: the timer service calls it from one task at a time.
Invariants (checked by the tests): every added offset is either in exactly one slot's
list, in ``overflow`` (due beyond the window: added again as it moves) or taken.
"""

from __future__ import annotations

from array import array

import numpy as np

PAGE_ENTRIES = 65_536  # links per page: 512 KiB


class TimerWheel:
    def __init__(self, window_s: int, first_second: int) -> None:
        if window_s < 2:
            raise ValueError(f"window_s must be at least 2, got {window_s}")
        self.window_s = window_s
        self.heads = array("q", [-1]) * window_s  # slot -> the last offset added, -1: empty
        self.next_second = first_second  # the first second not taken yet: slots cover [next, next + window)
        self.pending = 0
        self.overflow: list[tuple[int, int]] = []  # (queue offset, due second) beyond the window
        self._pages: dict[int, array[int]] = {}  # page number -> links
        self._page_pending: dict[int, int] = {}

    def add(self, queue_offset: int, due_second: int) -> None:
        """Schedule ``queue_offset`` for ``due_second`` (a second already taken: the
        next one to take, so it is delivered at once)."""
        second = max(due_second, self.next_second)
        if second >= self.next_second + self.window_s:
            self.overflow.append((queue_offset, due_second))
            return
        slot = second % self.window_s
        page_no, pos = divmod(queue_offset, PAGE_ENTRIES)
        page = self._page(page_no)
        page[pos] = self.heads[slot]
        self.heads[slot] = queue_offset
        self._page_pending[page_no] += 1
        self.pending += 1

    def add_many(self, offsets: np.ndarray, due_seconds: np.ndarray) -> None:
        """:meth:`add` for many offsets (ascending), vectorised: a scheduling burst of
        100,000 messages a second must not cost a Python call each. Within a slot the
        links come out as the same adds one by one would leave them."""
        seconds = np.maximum(due_seconds, self.next_second)
        far = seconds >= self.next_second + self.window_s
        if far.any():
            self.overflow += list(zip(offsets[far].tolist(), due_seconds[far].tolist()))
            offsets, seconds = offsets[~far], seconds[~far]
        if not len(offsets):
            return
        order = np.argsort(seconds % self.window_s, kind="stable")
        slots, qs = (seconds % self.window_s)[order], offsets[order].astype(np.int64)
        first = np.ones(len(slots), dtype=bool)
        first[1:] = slots[1:] != slots[:-1]
        last = np.ones(len(slots), dtype=bool)
        last[:-1] = first[1:]
        heads = np.frombuffer(self.heads, dtype=np.int64)  # a view: writes go to the array
        prev = np.empty_like(qs)
        prev[1:] = qs[:-1]
        prev[first] = heads[slots[first]]
        heads[slots[last]] = qs[last]
        pages = qs // PAGE_ENTRIES
        for page_no in np.unique(pages).tolist():
            sel = pages == page_no
            np.frombuffer(self._page(page_no), dtype=np.int64)[qs[sel] % PAGE_ENTRIES] = prev[sel]
            self._page_pending[page_no] += int(sel.sum())
        self.pending += len(qs)

    def _page(self, page_no: int) -> array[int]:
        page = self._pages.get(page_no)
        if page is None:
            page = self._pages[page_no] = array("q", [-1]) * PAGE_ENTRIES
            self._page_pending[page_no] = 0
        return page

    def take(self) -> list[int]:
        """The offsets due in second ``next_second`` (in the order added), and move the
        window on by one second."""
        slot = self.next_second % self.window_s
        out: list[int] = []
        q = self.heads[slot]
        while q >= 0:
            out.append(q)
            page_no, pos = divmod(q, PAGE_ENTRIES)
            q = self._pages[page_no][pos]
            self._release(page_no)
        self.heads[slot] = -1
        self.pending -= len(out)
        self.next_second += 1
        out.reverse()
        if self.overflow:
            self._refill()
        return out

    def skip_empty(self, until_second: int) -> None:
        """Move over empty slots up to (not past) ``until_second`` at once."""
        heads, window = self.heads, self.window_s
        while self.next_second < until_second and heads[self.next_second % window] < 0:
            self.next_second += 1
        if self.overflow:
            self._refill()

    def _release(self, page_no: int) -> None:
        left = self._page_pending[page_no] - 1
        if left:
            self._page_pending[page_no] = left
        else:
            del self._page_pending[page_no], self._pages[page_no]

    def _refill(self) -> None:
        """Add the overflow entries the window now reaches."""
        horizon = self.next_second + self.window_s
        waiting, self.overflow = self.overflow, []
        for q, due in waiting:
            if due < horizon:
                self.add(q, due)
            else:
                self.overflow.append((q, due))

    def lowest_pending(self) -> int | None:
        """A queue offset at or below every pending one (the first of the lowest page
        with one pending, or the overflow's lowest); None if none is pending. Safe to
        call from another thread: it only copies."""
        pages, overflow = list(self._page_pending), list(self.overflow)
        lows = [min(pages) * PAGE_ENTRIES] if pages else []
        lows += [min(q for q, _ in overflow)] if overflow else []
        return min(lows) if lows else None

    def memory_bytes(self) -> int:
        """Bytes the wheel holds (slots, link pages, overflow)."""
        return 8 * self.window_s + len(self._pages) * 8 * PAGE_ENTRIES + 64 * len(self.overflow)
