"""The broker's request handlers, by subject: pulls and offset look-ups
(``_queue_requests``, ``_fetch``), consumer groups (``_group_requests``), topics
(``_topic_requests``), produce (``_produce``), and the rest; :class:`Handlers` builds
the table of every request code's handler and answers BROKER_INFO.

Appends and every store call that may touch the disk run in worker threads
(``trio.to_thread``), so a slow disk holds up the requests that need it, not the event
loop: pulls and offset look-ups share ``pull_read_threads`` threads
(:class:`ReadThreads`); the records a pull found still go out with ``sendfile``.
Every request is checked (:func:`checked`) before its handler runs.
"""

from __future__ import annotations

import time
from typing import Any

from clmq.broker.store import StorageEngine
from clmq.protocol import Frame, RequestCode
from clmq.protocol.transport import Handler, Peer, Reply, checked

from ._access_rules import BROKER_RULES
from ._admin_requests import AdminRequests
from ._context import BrokerContext
from ._fetch import Fetch, ReadThreads
from ._group_requests import GroupRequests
from ._index_requests import IndexRequests
from ._locks import LockRequests
from ._log_reads import LogReads
from ._metrics import status_fields
from ._produce import Produce
from ._queue_requests import QueueRequests
from ._scheduled import ScheduledRequests
from ._security_requests import SecurityRequests
from ._sendback import SendBack
from ._topic_requests import TopicRequests
from .pop import PopRequests, PopService
from .timer import Timer
from .transaction import TransactionRequests, Transactions


class Handlers:
    """Every request the broker serves, bound to one broker's :class:`BrokerContext`."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.config = ctx.config
        # Pulls and look-ups read the disk in at most this many threads at once: a slow
        # read (a page fault, a busy disk) holds up the pulls that wait for a thread, never
        # the event loop that serves every connection.
        self.readers = ReadThreads(ctx.config.pull_read_threads)
        self.timer = Timer(ctx)
        self.scheduled = ScheduledRequests(ctx, self.timer)
        self.transactions = Transactions(ctx)
        self.transaction_requests = TransactionRequests(ctx, self.transactions)
        self.pop = PopService(ctx)  # POP consumption (docs/consuming.md)
        self.produce = Produce(ctx, self.readers, self.scheduled, self.transaction_requests.check_send)
        self.locks = LockRequests(ctx)
        self.started = time.monotonic()  # BROKER_INFO's uptime

    def table(self, more: dict[int, Handler]) -> dict[int, Handler]:
        """Every request code's handler (with ``more``: replication's), each behind the
        login check, :func:`checked`'s field checks and its ACL rule (``BROKER_RULES``);
        AUTHENTICATE behind the field checks alone."""
        log_reads = LogReads(self.ctx, self.readers)
        admin = AdminRequests(self.ctx)
        queues = QueueRequests(self.ctx, self.readers)
        groups = GroupRequests(self.ctx, self.locks)
        topics = TopicRequests(self.ctx, self.readers)
        handlers: dict[int, Handler] = {
            RequestCode.SEND_MESSAGE: self.produce.send_message,
            RequestCode.PULL_MESSAGE: queues.pull_message,
            RequestCode.PULL_MESSAGES: Fetch(self.ctx, self.readers).handle,
            RequestCode.QUERY_OFFSETS: queues.query_offsets,
            RequestCode.SEARCH_OFFSET: queues.search_offset,
            RequestCode.COMMIT_OFFSET: groups.commit_offset,
            RequestCode.QUERY_CONSUMER_OFFSET: groups.query_consumer_offset,
            RequestCode.QUERY_QUEUE_OFFSETS: queues.query_queue_offsets,
            RequestCode.HEARTBEAT: groups.heartbeat,
            RequestCode.UNREGISTER_CLIENT: groups.unregister_client,
            RequestCode.GET_GROUP_MEMBERS: groups.group_members,
            RequestCode.LIST_GROUPS: groups.list_groups,
            RequestCode.DESCRIBE_GROUP: groups.describe_group,
            RequestCode.DELETE_GROUP: admin.delete_group,
            RequestCode.CONSUMER_SEND_BACK: SendBack(self.ctx).handle,
            RequestCode.CANCEL_MESSAGE: self.scheduled.cancel,
            **self.transaction_requests.handlers(),
            **PopRequests(self.pop).handlers(),
            RequestCode.LOCK_QUEUES: self.locks.lock,
            RequestCode.UNLOCK_QUEUES: self.locks.unlock,
            RequestCode.GET_MESSAGE: admin.get_message,
            RequestCode.QUERY_INDEX: IndexRequests(self.ctx, self.readers).query_index,
            RequestCode.CREATE_TOPIC: topics.create_topic,
            RequestCode.DELETE_TOPIC: topics.delete_topic,
            RequestCode.LIST_TOPICS: topics.list_topics,
            RequestCode.DESCRIBE_TOPIC: topics.describe_topic,
            RequestCode.BROKER_INFO: self.broker_info,
            RequestCode.GET_LOG_LAYOUT: log_reads.layout,
            RequestCode.READ_LOG: log_reads.read_log,
            **SecurityRequests(self.ctx, self.ctx.security).handlers(),
            **more,
        }
        access = self.ctx.security.access
        guarded = access.guard_all(handlers, BROKER_RULES, lambda code: RequestCode(code).name)
        return {**guarded, RequestCode.AUTHENTICATE: checked(access.authenticate)}

    async def broker_info(self, frame: Frame, peer: Peer) -> Reply:
        c = self.config
        return Reply(
            {
                "broker_name": c.broker_name,
                "cluster": c.cluster,
                "addr": self.ctx.addr(),
                "storage_mode": c.storage_mode,
                "flush_mode": c.flush_mode,
                "end_offset": self.store.end_offset,
                "durable_offset": self.store.durable_offset,
                "dispatch_lag_bytes": self.store.dispatch_lag_bytes,
                "connections": self.ctx.connections(),
                "topics": len(self.store.topics.all()),
                "healthy": self.store.failure is None,
                "failure": health_text(self.store),
                "broker_id": c.broker_id,
                "role": self.ctx.replica.role,
                "epoch": self.ctx.replica.epoch,
                **self.timer_fields(),
                **self.transactions.fields(),
                **self.pop.fields(),
                **status_fields(self.ctx, self.started),
            }
        )

    def timer_fields(self) -> dict[str, int | str]:
        """BROKER_INFO's view of the timer (pending -1: not running here, e.g. a follower)."""
        t = self.timer
        return {
            "timer_pending": t.pending,
            "timer_failure": t.failure,
            "timer_delivered": t.stats.delivered,
            "timer_cancelled": t.stats.cancelled,
            "timer_undeliverable": t.stats.undeliverable,
            "timer_memory_bytes": t.memory_bytes(),
        }


def health_text(store: StorageEngine) -> str:
    """Why the store is unhealthy ("" if it is), as the broker reports it."""
    return "" if store.failure is None else str(store.failure)


def registration(ctx: BrokerContext) -> dict[str, Any]:
    """The fields of the broker's REGISTER_BROKER: its topics and its health (a broker
    whose store failed registers ``healthy: false`` and why: name servers keep it in the
    routes, marked, so that producers skip it and consumers still read it)."""
    c, store = ctx.config, ctx.store
    return {
        "cluster": c.cluster,
        "broker_name": c.broker_name,
        "addr": ctx.addr(),
        "topics": store.topics.all(),
        "healthy": store.failure is None,
        "failure": health_text(store),
        "broker_id": c.broker_id,
        "role": ctx.replica.role,
        "epoch": ctx.replica.epoch,
        "kafka_addr": ctx.kafka_addr(),
    }
