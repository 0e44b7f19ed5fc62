"""The broker's timer: scheduled messages, retries' back-off and their delivery
(RocketMQ 5's timer log and timing wheel, with the timer log replaced by the
``%TIMER%`` queue's own index; docs/consuming.md).

- ``_timer``: the task (ticks, snapshots, cancels).
- ``_due``: the entries due this second and the batch being appended (retention's floor reads them).
- ``_checkpoints``: saving the checkpoint, a follower adopting its leader's.
- ``_wheel``: the timing wheel, pure data (one slot per second, links in pages).
- ``_state``: the checkpoint and the rebuild at start.
- ``_delivery``: records read back and appended through the broker's lane.
"""

from ._state import CANCEL_QUEUE, SCHEDULED_QUEUE, TIMER_QUEUES
from ._timer import Timer, wall_ms

__all__ = [
    "CANCEL_QUEUE",
    "SCHEDULED_QUEUE",
    "TIMER_QUEUES",
    "Timer",
    "wall_ms",
]
