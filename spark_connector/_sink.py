"""The clmq sink: ``df.write.format("clmq")`` and ``df.writeStream.format("clmq")``.

Rows become messages sent through the public trio producer (``clmq.client.open_producer``),
one producer per Spark task, run by ``trio.run`` inside the task. Spark hands the rows
over as Arrow record batches (``DataSourceArrowWriter``); each batch's columns become
Python lists once, and every row is one ``Producer.submit`` (the producer's accumulator
batches them per queue into few requests). A task ends with a flush and fails with the
broker's error if any message failed for good; its commit message counts rows and bytes.

Guarantee: at least once. A Spark task that is retried sends its rows again, so a
topic may hold some rows twice; within a task, rows of one key keep their order.

Everything the writer checks (options, columns and their types) is checked when Spark
creates the writer on the driver, before any task runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import pyarrow as pa
import trio
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from clmq.client import Message, MessageQueue, NoRouteError, Producer, SendError, SendFuture, open_producer, shard
from clmq.common import ConnectorError
from clmq.protocol.transport import ClientSecurity, tls_settings

from ._options import OptionError

try:  # pyspark >= 4.1: Arrow batches for streams too
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamWriterBase

    STREAM_ARROW = True
except ImportError:  # pragma: no cover - pyspark 4.0: Rows
    from pyspark.sql.datasource import DataSourceStreamWriter as _StreamWriterBase  # type: ignore[assignment]

    STREAM_ARROW = False

log = logging.getLogger("clmq.spark")

ROW_CHUNK = 4096  # rows turned into column lists at once where Spark hands over Rows (pyspark 4.0 streams)

# Option (lower case, as Spark passes them) -> (its name as documented, producer keyword, default, minimum).
SETTINGS: dict[str, tuple[str, str, int, int]] = {
    "batchmaxbytes": ("batchMaxBytes", "batch_max_bytes", 1 << 20, 1),
    "lingerms": ("lingerMs", "linger_ms", 0, 0),
    "timeoutms": ("timeoutMs", "send_timeout_ms", 3000, 1),
    "retrybudgetms": ("retryBudgetMs", "retry_budget_ms", 15_000, 0),
}
ADDRESSES = ("nameserver", "nameservers", "broker", "brokers")
SPARKS = frozenset(("checkpointlocation",))  # Spark's own, passed on to a stream's sink: not the sink's to check
# TLS and a login (docs/security.md#tls): option (lower case) -> its documented name. The
# files must exist where the tasks run; unset, each task reads $CLMQ_TLS_* and $CLMQ_USER.
SECURITY = {
    "tlscafile": "tlsCaFile",
    "tlscertfile": "tlsCertFile",
    "tlskeyfile": "tlsKeyFile",
    "user": "user",
    "password": "password",
}
KNOWN = frozenset((*ADDRESSES, "topic", "queue", *SETTINGS, *SPARKS, *SECURITY))

# Column (lower case) -> the Spark types it may have (simpleString).
INTEGERS = ("int", "bigint", "smallint", "tinyint")
WRITTEN: dict[str, tuple[str, ...]] = {
    "body": ("binary", "string"),
    "key": ("string",),
    "keys": ("string",),
    "tag": ("string",),
    "tags": ("string",),
    "properties": ("map<string,string>",),
    "queue_id": INTEGERS,
    "topic": ("string",),
}
# What the reader returns and a message cannot be given: the broker sets these.
IGNORED = frozenset(
    (
        "queue_offset",
        "commitlog_offset",
        "born_timestamp",
        "store_timestamp",
        "born_host",
        "store_host",
        "reconsume_times",
    )
)


class SinkError(ConnectorError):
    """The sink cannot write a row: an unknown topic, a queue it does not have, a null body."""


@dataclass(frozen=True)
class SinkOptions:
    """The sink's options, parsed (see :func:`parse_sink_options`)."""

    nameservers: tuple[str, ...] = ()
    brokers: tuple[str, ...] = ()
    topic: str | None = None
    queue: int | None = None
    producer: tuple[tuple[str, int], ...] = ()  # the producer's keyword arguments
    security: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # tlsCaFile, ..., user, password given
    # (kept as text: the ClientSecurity is made where the task runs, whose files it checks)

    def producer_kwargs(self) -> dict[str, Any]:
        return dict(self.producer)

    def client_security(self) -> ClientSecurity | None:
        """The producer's security, or None (the task's environment decides)."""
        given = dict(self.security)
        if not given:
            return None
        try:
            tls = tls_settings(
                cert_file=given.get("tlsCertFile", ""),
                key_file=given.get("tlsKeyFile", ""),
                ca_file=given.get("tlsCaFile", ""),
            )
            return ClientSecurity(tls, given.get("user", ""), given.get("password", ""))
        except ValueError as e:
            raise OptionError(f"options tlsCaFile, tlsCertFile, tlsKeyFile, user, password: {e}") from None


def _addresses(name: str, raw: str) -> tuple[str, ...]:
    addrs = tuple(a.strip() for a in raw.split(",") if a.strip())
    for a in addrs:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OptionError(f"option {name}={raw!r}: expected host:port[,host:port]")
    if not addrs:
        raise OptionError(f"option {name}={raw!r}: expected host:port[,host:port]")
    return addrs


def _whole(name: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw.strip().replace("_", ""))
    except ValueError:
        raise OptionError(f"option {name}={raw!r}: expected a whole number") from None
    if value < minimum:
        raise OptionError(f"option {name}={value}: must be at least {minimum}")
    return value


def parse_sink_options(options: Mapping[str, Any]) -> SinkOptions:
    """Spark's options (any key case) for the sink; :class:`OptionError` names a bad one."""
    opts = {str(k).lower(): str(v) for k, v in options.items()}
    unknown = sorted(k for k in opts if k not in KNOWN)
    if unknown:
        raise OptionError(
            f"unknown sink option(s) {', '.join(unknown)}; the clmq sink takes: nameserver, broker, "
            f"topic, queue, {', '.join(s[0] for s in SETTINGS.values())}, {', '.join(SECURITY.values())}"
        )
    ns_name = next((n for n in ("nameservers", "nameserver") if n in opts), None)
    br_name = next((n for n in ("brokers", "broker") if n in opts), None)
    if (ns_name is None) == (br_name is None):
        raise OptionError("give one of: option nameserver=host:port[,host:port] or option broker=host:port")
    topic = opts.get("topic")
    if topic is not None and not topic.strip():
        raise OptionError("option topic='': expected a topic name")
    return SinkOptions(
        nameservers=_addresses(ns_name, opts[ns_name]) if ns_name else (),
        brokers=_addresses(br_name, opts[br_name]) if br_name else (),
        topic=topic.strip() if topic else None,
        queue=_whole("queue", opts["queue"], 0) if "queue" in opts else None,
        producer=tuple(
            (kw, _whole(name, opts[key], low) if key in opts else default)
            for key, (name, kw, default, low) in SETTINGS.items()
        ),
        security=tuple((name, opts[key]) for key, name in SECURITY.items() if opts.get(key)),
    )


@dataclass(frozen=True)
class SinkColumns:
    """Which input column (its name as given) carries each field; None: not given."""

    body: str
    body_is_text: bool
    keys: str | None = None
    tags: str | None = None
    properties: str | None = None
    queue_id: str | None = None
    topic: str | None = None

    def fields(self) -> dict[str, str]:
        """field -> column, for the fields given."""
        named = {
            "body": self.body,
            "keys": self.keys,
            "tags": self.tags,
            "properties": self.properties,
            "queue_id": self.queue_id,
            "topic": self.topic,
        }
        return {f: c for f, c in named.items() if c is not None}


def check_columns(schema: StructType, opts: SinkOptions) -> SinkColumns:
    """The columns of the rows to write, checked by name and type (errors name them)."""
    found: dict[str, str] = {}  # field -> column
    for f in schema.fields:
        name = f.name.lower()
        if name in IGNORED:
            continue  # the reader's columns the broker sets: a read DataFrame writes back as it is
        if name not in WRITTEN:
            raise OptionError(
                f"column {f.name!r} is not one the clmq sink writes: it writes body, key (or keys), "
                f"tag (or tags), properties, queue_id, topic; it ignores {', '.join(sorted(IGNORED))}"
            )
        kind = f.dataType.simpleString()
        if kind not in WRITTEN[name]:
            raise OptionError(f"column {f.name!r} must be {' or '.join(WRITTEN[name])}, not {kind}")
        field = {"key": "keys", "tag": "tags"}.get(name, name)
        if field in found:
            raise OptionError(f"columns {found[field]!r} and {f.name!r} both give the message's {field}: keep one")
        found[field] = f.name
    if "body" not in found:
        raise OptionError("the clmq sink needs a column 'body' (binary or string): each row's message body")
    if "topic" not in found and opts.topic is None:
        raise OptionError("option topic is required (or a column 'topic' with each row's topic)")
    body = found.pop("body")
    return SinkColumns(body, schema[body].dataType.simpleString() == "string", **found)


@dataclass
class SinkCommit(WriterCommitMessage):
    """What one task wrote: rows (messages) and their bodies' bytes."""

    rows: int
    body_bytes: int


def _totals(messages: Sequence[WriterCommitMessage | None]) -> tuple[int, int, int]:
    done = [m for m in messages if isinstance(m, SinkCommit)]
    return len(done), sum(m.rows for m in done), sum(m.body_bytes for m in done)


class ClmqWriter(DataSourceArrowWriter):
    """``df.write.format("clmq")``: each task sends its rows (see the module's docstring)."""

    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
        self.opts, self.columns = _checked(options, schema, overwrite)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommit:
        return send_all(self.opts, self.columns, (arrow_columns(b, self.columns) for b in iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        tasks, rows, size = _totals(messages)
        log.info("clmq sink: %d tasks wrote %d messages (%d bytes of bodies)", tasks, rows, size)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        tasks, rows, size = _totals(messages)
        log.warning(
            "clmq sink: write failed; %d tasks had sent %d messages (%d bytes) before (at least once: "
            "they stay in the topic)",
            tasks,
            rows,
            size,
        )


class ClmqStreamWriter(_StreamWriterBase):
    """``df.writeStream.format("clmq")``: each micro-batch as :class:`ClmqWriter` writes."""

    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
        self.opts, self.columns = _checked(options, schema, overwrite, "complete output mode")

    def write(self, iterator: Iterator[Any]) -> SinkCommit:
        if STREAM_ARROW:
            return send_all(self.opts, self.columns, (arrow_columns(b, self.columns) for b in iterator))
        return send_all(self.opts, self.columns, row_columns(iterator, self.columns))  # pragma: no cover

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        tasks, rows, size = _totals(messages)
        log.info("clmq sink: micro-batch %d: %d tasks wrote %d messages (%d bytes)", batchId, tasks, rows, size)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        tasks, rows, size = _totals(messages)
        log.warning(
            "clmq sink: micro-batch %d failed; %d tasks had sent %d messages (%d bytes) before "
            "(at least once: the batch is sent again when the query restarts)",
            batchId,
            tasks,
            rows,
            size,
        )


def _checked(
    options: dict[str, str], schema: StructType, overwrite: bool, what: str = "mode('overwrite')"
) -> tuple[SinkOptions, SinkColumns]:
    if overwrite:
        raise OptionError(f"the clmq sink only appends (a topic cannot be overwritten): {what} is not supported")
    opts = parse_sink_options(options)
    return opts, check_columns(schema, opts)


# ------------------------------------------------------------------ in the task
Columns = dict[str, list[Any]]  # field -> one batch's values


def arrow_columns(batch: pa.RecordBatch, cols: SinkColumns) -> Columns:
    """One Arrow batch's fields as Python lists (one conversion per column, in C)."""
    return {field: batch.column(name).to_pylist() for field, name in cols.fields().items()}


def row_columns(rows: Iterator[Any], cols: SinkColumns) -> Iterator[Columns]:
    """Spark Rows, ``ROW_CHUNK`` at a time, as :func:`arrow_columns` gives them."""
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == ROW_CHUNK:
            yield {field: [r[name] for r in chunk] for field, name in cols.fields().items()}
            chunk = []
    if chunk:
        yield {field: [r[name] for r in chunk] for field, name in cols.fields().items()}


def send_all(opts: SinkOptions, cols: SinkColumns, batches: Iterator[Columns]) -> SinkCommit:
    """Send every row of ``batches`` through one producer (this task's), then flush."""
    return trio.run(_send_all, opts, cols, batches)


async def _send_all(opts: SinkOptions, cols: SinkColumns, batches: Iterator[Columns]) -> SinkCommit:
    async with open_producer(
        list(opts.nameservers) or None,
        broker_addrs=list(opts.brokers) or None,
        security=opts.client_security(),
        **opts.producer_kwargs(),
    ) as producer:
        task = TaskSend(producer, opts)
        while True:
            # Spark's iterator reads a socket: off the event loop, so the producer's senders keep going.
            batch = await trio.to_thread.run_sync(next, batches, None)
            if batch is None:
                break
            await task.send(batch)
            task.check()
        await producer.flush()
    task.check()
    return SinkCommit(task.rows, task.body_bytes)


def by_key(mqs: Sequence[MessageQueue], msg: Message) -> MessageQueue:
    """The queue of a message's key: as the producer's ``sharding_key`` routing picks it.
    One selector for every key, so that the accumulator merges rows of different keys
    bound for one queue into one batch (a ``sharding_key`` per row would not)."""
    return mqs[shard(msg.keys, len(mqs))]


class QueueId:
    """The selector of a fixed queue id: the first queue (by broker name) with that id."""

    def __init__(self, queue_id: int) -> None:
        self.queue_id = queue_id

    def __call__(self, mqs: Sequence[MessageQueue], msg: Message) -> MessageQueue:
        for mq in mqs:
            if mq.queue_id == self.queue_id:
                return mq
        # the routes lost it since the task checked it: fail the row rather than put it elsewhere
        raise ValueError(f"no queue {self.queue_id} in the topic's routes any more (the topic changed while writing)")


class TaskSend:
    """One task's sends: rows to messages, the queue of each, and the first failure."""

    def __init__(self, producer: Producer, opts: SinkOptions) -> None:
        self.producer = producer
        self.opts = opts
        self.rows = 0
        self.body_bytes = 0
        self.error: BaseException | None = None
        self._queue_ids: dict[str, frozenset[int]] = {}  # topic -> its queue ids (checked once per task)
        self._selectors: dict[int, QueueId] = {}

    def _done(self, fut: SendFuture) -> None:
        if self.error is None:
            self.error = fut.exception()

    def check(self) -> None:
        """Raise the first message's failure (the broker's error), if any."""
        if self.error is not None:
            raise self.error

    async def _topic_queues(self, topic: str) -> frozenset[int]:
        ids = self._queue_ids.get(topic)
        if ids is None:
            try:
                mqs = await self.producer.routes.queues(topic)
            except NoRouteError as e:
                if e.unreachable:
                    raise
                raise SinkError(f"cannot write to topic {topic!r}: {e} (create it first: clmq topic create)") from None
            ids = self._queue_ids[topic] = frozenset(mq.queue_id for mq in mqs)
        return ids

    async def _selector(self, topic: str, queue_id: int | None, keys: str) -> Any:
        """The selector of a row's queue: its queue id, else by key, else None (round robin)."""
        known = await self._topic_queues(topic)
        if queue_id is None:
            return by_key if keys else None
        if queue_id not in known:
            raise SinkError(
                f"topic {topic!r} has no queue {queue_id} (column queue_id or option queue): its queue "
                f"ids are {min(known)}..{max(known)}"
            )
        sel = self._selectors.get(queue_id)
        if sel is None:
            sel = self._selectors[queue_id] = QueueId(queue_id)
        return sel

    async def send(self, batch: Columns) -> None:
        """Submit one batch's rows in order (a row's failure shows in :meth:`check`)."""
        n = len(batch["body"])
        # Option topic overrides the rows' topic column, as in Spark's Kafka sink: a DataFrame
        # read from one topic (it has the column) writes to another without a select.
        topics = [self.opts.topic] * n if self.opts.topic else batch.get("topic") or [None] * n
        keys = batch.get("keys") or [None] * n
        tags = batch.get("tags") or [None] * n
        props = batch.get("properties") or [None] * n
        queues = batch.get("queue_id") or [None] * n
        for i, body in enumerate(batch["body"]):
            topic = topics[i]
            if not topic or body is None:
                raise SinkError(self._missing(topic))
            qid = queues[i] if queues[i] is not None else self.opts.queue
            body = body.encode() if isinstance(body, str) else body
            sel = await self._selector(topic, qid, keys[i] or "")
            await self._submit(topic, body, tags[i] or "", keys[i] or "", _properties(props[i], self.rows), sel)

    def _missing(self, topic: str | None) -> str:
        if not topic:
            return f"row {self.rows} of this task: column topic is null or empty and no option topic is given"
        return f"row {self.rows} of this task (topic {topic!r}): column body is null (a message needs a body)"

    async def _submit(
        self, topic: str, body: bytes, tags: str, keys: str, props: dict[str, str] | None, selector: Any
    ) -> None:
        try:
            await self.producer.submit(
                topic, body, tags=tags, keys=keys, properties=props, selector=selector, callback=self._done
            )
        except NoRouteError as e:
            if e.unreachable:
                raise
            raise SinkError(f"cannot write to topic {topic!r}: {e}") from None
        except SendError as e:
            raise type(e)(f"row {self.rows} of this task (topic {topic!r}): {e}", e.code) from None
        self.rows += 1
        self.body_bytes += len(body)


def _properties(raw: Any, row: int) -> dict[str, str] | None:
    """A map column's value (a dict, or Arrow's list of pairs) as a dict; None if empty."""
    if not raw:
        return None
    props = dict(raw)
    for k, v in props.items():
        if v is None:
            raise SinkError(f"row {row} of this task: column properties has a null value for {k!r}")
    return props
