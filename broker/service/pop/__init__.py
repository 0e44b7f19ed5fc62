"""POP consumption on the broker (RocketMQ 5's POP, Kafka share groups' model;
docs/consuming.md): any number of members take messages from any queue, each
acknowledged on its own; one not acknowledged within its invisible time is delivered
again, and after ``max_reconsume_times`` more attempts dead-lettered.

- ``_service``: :class:`PopService`, the API (native requests and Kafka share groups).
- ``_taking``, ``_take``: what a pop takes (fairness across queues, orderly, limits).
- ``_base``: the state's checks, acknowledgements, the recorded writes.
- ``_revive``: the leader's task (visible again, dead letters, checkpoint), start, stand-down.
- ``_inflight``: the in-flight state, pure data; ``_records``: CK/ACK records and handles.
- ``_state``: the checkpoint file and the replay of ``%POP%``; ``_reads``: queue reads.
- ``_requests``: POP_MESSAGE, ACK_MESSAGE, CHANGE_INVISIBLE_TIME; ``_metrics``: Prometheus.
"""

from ._base import Delivery
from ._metrics import PopCollector
from ._requests import PopRequests
from ._service import PopService

__all__ = ["Delivery", "PopCollector", "PopRequests", "PopService"]
