"""Transactional messages on the broker (RocketMQ's model: half messages, op records,
check-back; docs/transactions.md).

- ``_service``: the pending set of this leader, the checker task, the checkpoint.
- ``_requests``: the door (SEND_MESSAGE to ``%TRANS_HALF%``), END/CHECK/LIST_TRANSACTIONS.
- ``_ending``: what a commit, a rollback and a check append, and how.
- ``_pending``: the pending and recently ended half messages, pure data.
- ``_state``: the checkpoint and the rebuild at start (what is durable and why).
- ``_metrics``: the Prometheus collector.
- ``_marks``: the plain door's refusal of ``TRAN_HALF`` (the broker's mark of a commit).
"""

from ._marks import refuse_tran_half
from ._metrics import TransactionCollector
from ._requests import TransactionRequests
from ._service import Transactions

__all__ = ["TransactionCollector", "TransactionRequests", "Transactions", "refuse_tran_half"]
