"""Cold reads (issue 17): a pull of data no longer in the page cache is read in a cold
read thread, into bytes, never ``sendfile``'d on the event loop; pulls of cached data
still go out with ``sendfile``; a cold read's failure is an error reply.

Data is made cold for real: ``fsync``, then ``posix_fadvise(DONTNEED)`` on every file
of the broker's data directory, again until no page of it is counted (by cachestat,
else by mincore). The page-cache checks are tried both ways: by cachestat, and as on
a kernel without it (``way``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.service import Broker, BrokerConfig
from clmq.broker.service._read_threads import ColdReads, ReadStats, ReadThreads, ResidentSpan
from clmq.broker.store import Span, Store
from clmq.client import RpcClient
from clmq.commitlog import _pagecache, pages_missing, read_exactly
from clmq.commitlog._pagecache import PAGE, cached_pages, read_pages
from clmq.commitlog._pagecache import _mincore as mincore_missing
from clmq.common import Message
from clmq.protocol import ErrorCode, FetchResult, PullStatus, RequestCode, decode_records, encode_batch
from clmq.protocol.transport._spans import SPAN_COUNTERS
from tests.service_helpers import Cluster

TOPIC = "cold"
BODY_BYTES = 16 * 1024
MESSAGES = 128  # 2 MiB in one queue: far more than the kernel's readahead of a header read


EVICT_MAX_S = 10.0
DRAIN_CHUNK_BYTES = 1 << 20


def evict_fd(fd: int) -> None:
    """The whole open file out of the page cache. DONTNEED skips pages that are locked:
    a readahead the kernel started earlier (a read starts one past its end) may still
    be filling pages, which appear after the call. So: again, until no page of the file
    is counted, for at most EVICT_MAX_S. Counted by cachestat where this kernel has it;
    else by mincore, which sees no page still being read: so the whole file is read
    first, which waits for every read in flight (the files here are a few MiB)."""
    counting = cached_pages(fd, 0, PAGE) is not None
    give_up = time.monotonic() + EVICT_MAX_S
    while True:
        if not counting:
            _drain(fd)
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size + PAGE
        cached = cached_pages(fd, 0, size) if counting else read_pages(fd, 0, size)
        if not cached:  # none left, or this system cannot count them
            return
        assert time.monotonic() < give_up, f"{cached} pages of fd {fd} still cached after {EVICT_MAX_S} s"


def _drain(fd: int) -> None:
    """Read the file to its end: returns once no read of it is in flight (a readahead
    never goes past the end, and a read waits for the pages it covers)."""
    position = 0
    while chunk := os.pread(fd, DRAIN_CHUNK_BYTES, position):
        position += len(chunk)


def evict(root: Path) -> None:
    """Every file under ``root`` out of the page cache (dirty pages are written first)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                evict_fd(fd)
            finally:
                os.close(fd)


@pytest.fixture(params=["cachestat", "mincore"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the page cache is asked: by cachestat where this kernel has it, and as on
    a kernel (or behind a container's seccomp filter) without it: by mincore, while
    these tests cannot count cached pages with cachestat either."""
    if request.param == "mincore":
        monkeypatch.setattr(_pagecache, "_how", ["mincore"])
        monkeypatch.setattr(sys.modules[__name__], "cached_pages", lambda fd, position, length: None)
    return str(request.param)


def stats_of(broker: Broker) -> ReadStats:
    readers: ReadThreads = broker.handlers.readers
    return readers.stats


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker("broker-a")
    await c.create_topic(TOPIC, 2)
    return c


async def fill(rpc: RpcClient, broker: Broker, queue_id: int = 0) -> list[bytes]:
    """MESSAGES distinct bodies in one queue (one contiguous run of the log), dispatched."""
    bodies = [os.urandom(BODY_BYTES) for _ in range(MESSAGES)]
    for i in range(0, MESSAGES, 32):
        batch = encode_batch([Message(TOPIC, queue_id, b) for b in bodies[i : i + 32]])
        reply = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": TOPIC}, batch)
        assert reply.error_code == 0, reply.error_text
    assert isinstance(broker.store, Store)
    broker.store.catch_up()
    return bodies


async def pull(rpc: RpcClient, broker: Broker, offset: int, queue_id: int = 0, limit: int = MESSAGES) -> Any:
    fields = {"queues": [[TOPIC, queue_id, offset, None]], "max_messages": limit, "max_per_queue": limit}
    return await rpc.request(broker.addr, RequestCode.PULL_MESSAGES, fields, timeout_ms=30_000, check=False)


def data_dir(broker: Broker) -> Path:
    return Path(broker.config.data_dir)


async def test_a_pull_of_evicted_data_is_read_by_a_cold_thread_with_exactly_the_stored_bytes(
    way: str, cluster: Cluster, nursery: trio.Nursery
) -> None:
    broker = cluster.brokers["broker-a"]
    rpc = RpcClient(nursery)
    bodies = await fill(rpc, broker)
    evict(data_dir(broker))
    stats = stats_of(broker)
    before_bytes, before_cold = stats.cold_bytes, stats.cold_pulls
    half = MESSAGES // 2
    first = await pull(rpc, broker, 0, limit=half)
    assert first.error_code == 0, first.error_text
    assert [r.body for r in decode_records(first.body)] == bodies[:half]
    assert stats.cold_bytes > before_bytes, "the evicted records were read into bytes by the cold path"
    evict(data_dir(broker))
    second = await pull(rpc, broker, half)  # where the first left off: known cold, straight to the cold threads
    assert [r.body for r in decode_records(second.body)] == bodies[half:]
    assert stats.cold_pulls == before_cold + 1


async def test_a_cold_reader_does_not_send_a_tail_reader_to_the_cold_threads(
    way: str, cluster: Cluster, nursery: trio.Nursery
) -> None:
    broker = cluster.brokers["broker-a"]
    rpc = RpcClient(nursery)
    await fill(rpc, broker)
    evict(data_dir(broker))
    stats = stats_of(broker)
    cold = await pull(rpc, broker, 0, limit=MESSAGES // 2)  # queue 0, evicted: found cold, remembered
    assert cold.error_code == 0 and stats.cold_bytes > 0
    tail = await fill(rpc, broker, queue_id=1)  # queue 1, just written: cached
    hot_pulls, cold_pulls = stats.hot_pulls, stats.cold_pulls
    reply = await pull(rpc, broker, 0, queue_id=1)
    assert [r.body for r in decode_records(reply.body)] == tail
    assert (stats.hot_pulls, stats.cold_pulls) == (hot_pulls + 1, cold_pulls)


async def test_a_pull_of_cached_data_is_sent_with_sendfile(way: str, cluster: Cluster, nursery: trio.Nursery) -> None:
    broker = cluster.brokers["broker-a"]
    rpc = RpcClient(nursery)
    bodies = await fill(rpc, broker, queue_id=1)
    stats = stats_of(broker)
    cold_bytes, resident, sent = stats.cold_bytes, stats.resident_spans, SPAN_COUNTERS["sendfile_spans"]
    reply = await pull(rpc, broker, 0, queue_id=1)
    assert [r.body for r in decode_records(reply.body)] == bodies
    assert stats.cold_bytes == cold_bytes
    assert stats.resident_spans > resident
    assert SPAN_COUNTERS["sendfile_spans"] > sent


@pytest.mark.parametrize("fault", ["removed", "truncated"])
async def test_a_cold_read_that_fails_is_an_error_reply_and_the_connection_goes_on(
    cluster: Cluster, nursery: trio.Nursery, fault: str
) -> None:
    broker = cluster.brokers["broker-a"]
    rpc = RpcClient(nursery)
    await fill(rpc, broker)
    evict(data_dir(broker))
    segments = [p for p in (data_dir(broker) / "commitlog").rglob("*") if p.is_file()]
    assert segments
    for seg in segments:
        if fault == "removed":
            seg.unlink()
        else:
            os.truncate(seg, 64 * 1024)  # the first records only: the rest of the pull is a short read
    reply = await pull(rpc, broker, 0)
    if reply.error_code == 0:  # the store found the damage itself: the queue's row says so
        row = FetchResult.from_wire(reply.fields["results"][0])
        assert row.status is PullStatus.CORRUPT or row.count < MESSAGES
    else:
        assert reply.error_code in (ErrorCode.IO_ERROR, ErrorCode.SYSTEM_ERROR), reply.error_text
    again = await rpc.request(broker.addr, RequestCode.QUERY_OFFSETS, {"topic": TOPIC, "queue_id": 1})
    assert again.fields["max_offset"] == 0


# ------------------------------------------------------------------ the read threads
class Boom(Exception):
    pass


def _fail(what: str) -> None:
    raise Boom(what)


@pytest.mark.parametrize("pool", ["hot", "cold"])
async def test_an_exception_in_a_read_thread_reaches_the_waiting_request_and_the_pool_goes_on(pool: str) -> None:
    hot = ReadThreads(2, idle_s=0.05)
    threads = hot if pool == "hot" else hot.cold_pool(1)
    for i in range(3):  # the same threads, again and again
        with pytest.raises(Boom, match=f"job {i}"):
            await threads.in_thread(_fail, f"job {i}")
        assert await threads.in_thread(sum, [i, 1]) == i + 1


# ------------------------------------------------------ residency check, read path
@dataclass(frozen=True)
class Blob:
    """A file of random bytes (its data left out of the repr Hypothesis prints)."""

    path: Path
    data: bytes = field(repr=False)


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory) -> Blob:
    path = tmp_path_factory.mktemp("cold") / "blob"
    data = os.urandom(4 * 1024 * 1024 + 123)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # clean pages only: dirty ones are not dropped from the cache
    os.close(fd)
    return Blob(path, data)


spans = st.integers(0, 4 * 1024 * 1024 + 122).flatmap(
    lambda pos: st.tuples(st.just(pos), st.integers(1, 4 * 1024 * 1024 + 123 - pos))
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(span=spans)
def test_a_range_is_missing_once_evicted_and_present_once_read(way: str, blob: Blob, span: tuple[int, int]) -> None:
    path, data = blob.path, blob.data
    pos, length = span
    fd = os.open(path, os.O_RDONLY)
    try:
        evict_fd(fd)
        assert pages_missing(fd, pos, length) is True
        assert mincore_missing(fd, pos, length) is True  # the fallback without cachestat
        assert read_exactly(fd, pos, length, str(path)) == data[pos : pos + length]
        assert pages_missing(fd, pos, length) is False
        assert mincore_missing(fd, pos, length) is False
    finally:
        os.close(fd)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chosen=st.lists(spans, min_size=1, max_size=6), evicted=st.booleans())
def test_the_cold_read_path_gives_every_byte_of_the_file(
    way: str, blob: Blob, chosen: list[tuple[int, int]], evicted: bool
) -> None:
    path, data = blob.path, blob.data
    if evicted:
        fd = os.open(path, os.O_RDONLY)
        try:
            evict_fd(fd)
        finally:
            os.close(fd)
    reads = ColdReads(ReadThreads(1), cold_threads=1, memory=16, distance_bytes=1 << 30)
    classified, missing = reads._classify([Span(str(path), p, n) for p, n in chosen])
    if evicted:  # else what earlier examples read (and its readahead) decides
        assert missing and not any(isinstance(s, ResidentSpan) for s in classified)
    filled = reads._fill(classified)
    for (p, n), s in zip(chosen, filled):
        assert (s.data is None) == isinstance(s, ResidentSpan)
        if s.data is None:
            with open(path, "rb") as f:
                assert os.pread(f.fileno(), s.length, s.position) == data[p : p + n]
        else:
            assert s.data == data[p : p + n]


NOBODY = 65534


def _as_nobody(fn: Any) -> str:
    """``repr(fn())`` computed in a forked child running as user and group ``NOBODY``
    (no exec: the interpreter may live where that user cannot read)."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(rd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(wr, repr(fn()).encode())
        except BaseException as e:  # reported to the parent, whatever it was
            os.write(wr, f"failed: {e!r}".encode())
        finally:
            os._exit(0)
    os.close(wr)
    with os.fdopen(rd, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def test_a_file_this_process_may_not_write_is_never_reported_cached(way: str, blob: Blob) -> None:
    """mincore shows every page of a file mapping as present to a process that neither
    owns the file nor may write it, and cachestat refuses such a file: the check then
    cannot tell (None, or missing where cachestat answers), never "cached", and the
    way chosen for the process's own files stays."""
    assert os.geteuid() == 0, "run as root (as CI does): the check runs as another user"
    fd = os.open(blob.path, os.O_RDONLY)  # root's file, 0644: readable, not writable, by NOBODY
    try:
        evict_fd(fd)
        got = _as_nobody(lambda: (read_pages(fd, 0, PAGE), pages_missing(fd, 0, PAGE), _pagecache._how[0]))
        assert got in (f"(None, None, '{way}')", f"(None, True, '{way}')"), got
        assert pages_missing(fd, 0, PAGE) is True, "the owner sees the page missing"
    finally:
        os.close(fd)


def test_a_span_past_the_end_of_its_file_is_an_error_not_short_bytes(blob: Blob) -> None:
    path, data = blob.path, blob.data
    reads = ColdReads(ReadThreads(1), cold_threads=1, memory=16, distance_bytes=1 << 30)
    with pytest.raises(OSError, match="ended at"):
        reads._fill([Span(str(path), len(data) - 10, 20)])


@pytest.mark.parametrize("code", [RequestCode.READ_LOG, RequestCode.PULL_MESSAGE])
async def test_an_uncached_span_of_any_reply_is_read_in_a_thread_not_sendfiled_on_the_event_loop(
    way: str, cluster: Cluster, nursery: trio.Nursery, code: int
) -> None:
    """READ_LOG (a follower's catch-up goes the same way) and PULL_MESSAGE send their
    spans as they are: send_spans itself checks the page cache."""
    broker = cluster.brokers["broker-a"]
    rpc = RpcClient(nursery)
    bodies = await fill(rpc, broker)
    assert isinstance(broker.store, Store)
    end = broker.store.log.write_offset
    await trio.to_thread.run_sync(broker.store.log.flush)  # READ_LOG serves durable bytes only
    evict(data_dir(broker))
    read_in_thread, sent = SPAN_COUNTERS["thread_read_spans"], SPAN_COUNTERS["sendfile_spans"]
    if code == RequestCode.READ_LOG:
        fields: dict[str, Any] = {"offset": 0, "max_bytes": end, "end_offset": end}
    else:
        fields = {"topic": TOPIC, "queue_id": 0, "offset": 0, "max_messages": MESSAGES}
    reply = await rpc.request(broker.addr, code, fields, timeout_ms=30_000)
    assert [r.body for r in decode_records(reply.body)] == bodies
    assert SPAN_COUNTERS["thread_read_spans"] > read_in_thread
    assert SPAN_COUNTERS["sendfile_spans"] == sent


@pytest.mark.parametrize(
    "setting", ["pull_read_threads", "cold_read_threads", "cold_read_memory_queues", "cold_read_distance_bytes"]
)
def test_read_pool_settings_below_one_are_refused_naming_the_setting(setting: str) -> None:
    with pytest.raises(ValueError, match=setting):
        BrokerConfig(**{setting: 0})
