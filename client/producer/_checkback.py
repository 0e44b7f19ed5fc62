"""The check-back (RocketMQ's ``checkTransactionState``): a producer with a
``transaction_group`` and a ``transaction_listener`` long-polls CHECK_TRANSACTIONS on
every broker group's leader (the leaders come from the name servers, or the broker
addresses given, and are looked up again every ``CHECK_LEADERS_REFRESH_MS``), which also
makes it a live producer of its group there. Each half message the broker asks about is
given to ``check_local_transaction`` (at most ``transaction_check_concurrency`` at a
time, each within ``transaction_check_timeout_ms``); COMMIT or ROLLBACK is answered with
END_TRANSACTION(from_check), UNKNOWN with nothing (the broker asks again later)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from typing import Any

import trio

from clmq.common import PROP_REAL_QID, PROP_REAL_TAGS, PROP_REAL_TOPIC, CorruptRecordError, Record
from clmq.protocol import ErrorCode, RequestCode, decode_records
from clmq.protocol.transport import ConnectionFailed, RpcError

from .._admin_calls import AdminCalls
from .._routes import MessageQueue
from ._transaction import LocalTransactionState, TransactionalProducer, TransactionListener, decide, end_transaction

log = logging.getLogger("clmq.producer")

CHECK_POLL_WAIT_MS = 5_000  # a CHECK_TRANSACTIONS long poll waits at most this long at the broker
CHECK_POLL_MAX_MESSAGES = 64  # half messages asked for per poll
CHECK_LEADERS_REFRESH_MS = 2_000  # the leaders are looked up again this often (a failover's new leader)
CHECK_FAILURE_BACKOFF_MS = 500  # after a failed poll, this long before the next


def real_view(record: Record) -> Record:
    """A half record as the listener sees it: its real topic, queue id and tags (the rest,
    offsets included, are the half copy's)."""
    p = record.properties
    try:
        queue_id = int(p.get(PROP_REAL_QID, record.queue_id))
    except ValueError:
        queue_id = record.queue_id
    return replace(
        record, topic=p.get(PROP_REAL_TOPIC, record.topic), queue_id=queue_id, tags=p.get(PROP_REAL_TAGS, "")
    )


def _readable(addr: str, record: Record) -> bool:
    """Whether a half record's properties parse (read lazily: a faulty writer's do not).
    One that does not is logged and skipped, as a damaged answer is; the others of the
    answer are checked."""
    try:
        record.properties  # noqa: B018  # decoded here, once, rather than inside the check
    except CorruptRecordError as e:
        log.warning(
            "transaction checks at %s: half message at log offset %d skipped: %s", addr, record.commitlog_offset, e
        )
        return False
    return True


def client_id(producer_id: str) -> str:
    """The producer's id at the brokers: host, process, the producer's own random id."""
    return f"{socket.gethostname()}@{os.getpid()}@{producer_id}"


class CheckBack:
    """The check-back task of one producer: :meth:`run` until cancelled."""

    def __init__(
        self,
        producer: TransactionalProducer,
        listener: TransactionListener,
        concurrency: int,
        timeout_ms: int,
    ) -> None:
        self.producer = producer
        self.listener = listener
        self.group = str(producer.options.transaction_group)
        self.client_id = client_id(producer.ids.producer_id)
        self.limiter = trio.CapacityLimiter(concurrency)
        self.timeout_ms = timeout_ms
        routes = producer.routes
        self.calls = AdminCalls(
            producer.rpc, routes.namesrv_addrs, routes.broker_addrs, producer.options.send_timeout_ms
        )
        self.polling: set[str] = set()  # leaders polled now
        self._nursery: trio.Nursery | None = None  # the polls' (run's)
        self.answered = 0  # checks answered with COMMIT or ROLLBACK (for tests and logs)
        self.unknown = 0  # checks left UNKNOWN

    async def run(self) -> None:
        """Poll every leader; look the leaders up again every ``CHECK_LEADERS_REFRESH_MS``."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while True:
                for addr in await self._leaders():
                    self._start(addr)
                await trio.sleep(CHECK_LEADERS_REFRESH_MS / 1000)

    def _start(self, addr: str) -> None:
        if addr and addr not in self.polling and self._nursery is not None:
            self.polling.add(addr)
            self._nursery.start_soon(self._poll, addr)

    async def _leaders(self) -> list[str]:
        try:
            with trio.fail_after(self.producer.options.send_timeout_ms / 1000 * 2):
                return [str(b["addr"]) for b in await self.calls.leaders()]
        except (ConnectionFailed, RpcError, trio.TooSlowError) as e:
            log.warning("transaction checks of group %s: no leaders known: %s", self.group, e or "timed out")
            return []

    async def _poll(self, addr: str) -> None:
        """Long-poll ``addr`` until it is no leader (NOT_LEADER: the leader it names is
        polled at once), unreachable, or does not serve checks; the refresh starts a new
        poll if it is a leader again."""
        fields = {
            "group": self.group,
            "client_id": self.client_id,
            "max_messages": CHECK_POLL_MAX_MESSAGES,
            "max_wait_ms": CHECK_POLL_WAIT_MS,
        }
        timeout_ms = CHECK_POLL_WAIT_MS + self.producer.options.send_timeout_ms
        try:
            while True:
                try:
                    reply = await self.producer.rpc.request(
                        addr, RequestCode.CHECK_TRANSACTIONS, fields, timeout_ms=timeout_ms, check=False
                    )
                except (ConnectionFailed, trio.TooSlowError) as e:
                    log.info("transaction checks at %s stopped: %s", addr, e or "timed out")
                    return
                code = reply.error_code
                if code in (ErrorCode.NOT_LEADER, ErrorCode.REQUEST_NOT_SUPPORTED):
                    leader = reply.fields.get("leader_addr")
                    self.polling.discard(addr)
                    self._start(leader if isinstance(leader, str) and leader != addr else "")
                    return
                if code:
                    level = logging.INFO if code == ErrorCode.SYSTEM_BUSY else logging.WARNING
                    log.log(level, "transaction checks at %s: %s", addr, RpcError(addr, code, reply.error_text))
                    await trio.sleep(CHECK_FAILURE_BACKOFF_MS / 1000)
                    continue
                await self._answer(addr, reply.fields, reply.body)
        finally:
            self.polling.discard(addr)

    async def _answer(self, addr: str, fields: dict[str, Any], body: bytes) -> None:
        """Check every half record of one answer (bounded concurrency), answer each."""
        if not body:
            return
        try:
            records = decode_records(bytes(body), f"CHECK_TRANSACTIONS answer from {addr}")
        except Exception as e:  # a damaged answer: the broker asks again later
            log.warning("transaction checks at %s: an answer could not be read: %s", addr, e)
            return
        async with trio.open_nursery() as nursery:
            for record in records:
                if _readable(addr, record):
                    nursery.start_soon(self._check_one, addr, record)

    async def _check_one(self, addr: str, record: Record) -> None:
        async with self.limiter:
            state = await self.check(record)
        if state is LocalTransactionState.UNKNOWN:
            self.unknown += 1
            return
        queue = MessageQueue(record.properties.get(PROP_REAL_TOPIC, ""), "", 0, addr)
        try:
            await end_transaction(self.producer, queue, record.commitlog_offset, state, from_check=True)
            self.answered += 1
        except (RpcError, ConnectionFailed, trio.TooSlowError) as e:
            log.warning("answering the check of %s@%X failed: %s", addr, record.commitlog_offset, e)

    async def check(self, record: Record) -> LocalTransactionState:
        """``check_local_transaction`` of the record's real view, within the timeout."""
        what = f"check_local_transaction of {record.properties.get('UNIQ_KEY', record.commitlog_offset)}"
        with trio.move_on_after(self.timeout_ms / 1000):
            return await decide(self.listener.check_local_transaction, real_view(record), what=what)
        log.warning("%s took over %d ms: UNKNOWN (the broker asks again later)", what, self.timeout_ms)
        return LocalTransactionState.UNKNOWN


def start_check_back(nursery: trio.Nursery, producer: Any) -> trio.CancelScope | None:
    """Start the check-back of ``producer`` (a :class:`Producer`) if it has a transaction
    group and a listener; the scope that stops it (None: not started)."""
    options = producer.options
    if options.transaction_listener is None or not options.transaction_group:
        return None
    scope = trio.CancelScope()
    checks = CheckBack(
        producer,
        options.transaction_listener,
        options.transaction_check_concurrency,
        options.transaction_check_timeout_ms,
    )

    async def run() -> None:
        with scope:
            await checks.run()

    nursery.start_soon(run)
    return scope
