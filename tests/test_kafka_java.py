"""The Kafka listener judged by the official Java client (kafka-clients, the version in
tests/java/kafka-harness/pom.xml) against a real broker process: the producer with its
defaults (idempotent, acks=all) in every codec, a consumer in a group reading back byte
for byte and committing, the AdminClient's topic and group calls, and a transactional
producer refused with a message the client shows.

The harness (tests/java/kafka-harness/KafkaHarness.java) runs as one JVM per scenario;
records cross as tab-separated base64 lines, checked facts as ``fact`` lines.
"""

from __future__ import annotations

import base64
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq import open_admin, open_consumer
from clmq.common import PROP_KAFKA_PRODUCER
from clmq.protocol.auth import AclBinding
from tests import java_deps
from tests.kafka_procs import KafkaCluster, open_kafka, open_secure_kafka, registered
from tests.test_kafka_security import create_topics, end_offset, wire_as

CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]
PER_CODEC = 4000  # 20,000 records in all

# (partition, offset, key, value, timestamp, headers)
Row = tuple[int, int, bytes | None, bytes | None, int, tuple[tuple[str, bytes | None], ...]]


@pytest.fixture(scope="module")
def harness() -> list[str]:
    return java_deps.harness_command()


@pytest.fixture
async def kafka(tmp_path: Path) -> Any:
    async with open_kafka(tmp_path) as cluster:
        yield cluster


class Run:
    def __init__(self, rc: int, stdout: str, stderr: str) -> None:
        self.rc, self.stdout, self.stderr = rc, stdout, stderr
        self.facts: dict[str, list[str]] = {}
        self.rows: list[Row] = []
        for line in stdout.splitlines():
            if line.startswith("fact\t"):
                _, name, value = line.split("\t", 2)
                self.facts.setdefault(name, []).append(value)
            elif line:
                self.rows.append(_parse(line))

    def fact(self, name: str) -> str:
        values = self.facts.get(name)
        assert values and len(values) == 1, f"fact {name!r}: {values}\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}"
        return values[0]


async def run_harness(harness: list[str], *args: str, stdin: bytes = b"", timeout_s: float = 90) -> Run:
    """One harness command; the harness bounds its own waits below ``timeout_s``."""
    with trio.fail_after(timeout_s):
        done = await trio.run_process(
            [*harness, *args], stdin=stdin, capture_stdout=True, capture_stderr=True, check=False
        )
    return Run(done.returncode, done.stdout.decode(), done.stderr.decode())


def _b64(b: bytes | None) -> str:
    return "-" if b is None else base64.b64encode(b).decode()


def _unb64(s: str) -> bytes | None:
    return None if s == "-" else base64.b64decode(s)


def _parse(line: str) -> Row:
    part, offset, key, value, ts, headers = line.split("\t")
    pairs = [h.split(":", 1) for h in headers.split(",")] if headers else []
    hs = tuple(((_unb64(n) or b"").decode(), _unb64(v)) for n, v in pairs)
    return int(part), int(offset), _unb64(key), _unb64(value), int(ts), hs


def _record(i: int, codec: str) -> tuple[bytes | None, bytes | None, int, tuple[tuple[str, bytes | None], ...]]:
    """Varied records: text, binary, empty and null keys; null values; repeated, binary,
    null and non-ASCII headers; each its own timestamp."""
    key: bytes | None = f"{codec}-key-{i}".encode()
    if i % 7 == 1:
        key = None
    elif i % 7 == 2:
        key = b"\xff\xfe\x00" + bytes([i % 256])
    elif i % 7 == 3:
        key = b""
    value: bytes | None = f"{codec}-value-{i:05d}".encode() + bytes(i % 300)
    if i % 11 == 4:
        value = None
    headers: tuple[tuple[str, bytes | None], ...] = (("h", b"x"),)
    if i % 3 == 0:
        headers = (("h", b"x"), ("h", b"\x00\xff"), ("n", None), ("ü", "é".encode()))
    if i % 5 == 0:
        headers = ()
    return key, value, 1_600_000_000_000 + i * 7, headers


def _lines(records: list[Any]) -> bytes:
    out = []
    for key, value, ts, headers in records:
        hs = ",".join(f"{_b64(n.encode())}:{_b64(v)}" for n, v in headers)
        out.append(f"{_b64(key)}\t{_b64(value)}\t{ts}\t{hs}\n")
    return "".join(out).encode()


async def test_java_producer_every_codec_then_group_consumer_reads_back_exactly(
    kafka: KafkaCluster, harness: list[str]
) -> None:
    await registered(kafka.namesrv)
    async with open_admin([kafka.namesrv]) as admin:
        await admin.create_topic("java", 3)
    sent: list[Row] = []
    for codec in CODECS:
        records = [_record(i, codec) for i in range(PER_CODEC)]
        run = await run_harness(harness, "produce", kafka.bootstrap, "java", codec, stdin=_lines(records))
        assert run.rc == 0, f"{codec}: {run.facts}\n{run.stderr[-3000:]}"
        assert len(run.rows) == PER_CODEC, codec
        # every record acknowledged at its own offset, echoed with what was sent
        assert [(r[2], r[3], r[4], r[5]) for r in run.rows] == records, codec
        sent += run.rows
    assert len({(r[0], r[1]) for r in sent}) == len(sent) == PER_CODEC * len(CODECS)
    ends = {p: max(r[1] for r in sent if r[0] == p) + 1 for p in {r[0] for r in sent}}
    assert set(ends) == {0, 1, 2}, "the default partitioner spreads keyed records over every partition"
    assert all(end == sum(1 for r in sent if r[0] == p) for p, end in ends.items()), "offsets are dense from 0"

    read = await run_harness(harness, "consume", kafka.bootstrap, "java", "java-readers", str(len(sent)))
    assert read.rc == 0, f"{read.facts}\n{read.stderr[-3000:]}"
    assert sorted(read.rows) == sorted(sent)
    per_partition = Counter(r[0] for r in read.rows)
    assert all(  # each partition in offset order
        [r[1] for r in read.rows if r[0] == p] == sorted(r[1] for r in read.rows if r[0] == p) for p in per_partition
    )
    assert read.fact("committed") == read.fact("positions") == _java_map(ends)

    # clmq's own consumer reads the same store: the idempotent producer's id on each message
    async with open_consumer([kafka.namesrv], "native", {"java": "*"}, start_from="earliest", pull_wait_ms=200) as c:
        seen: dict[tuple[int, int], Any] = {}
        with trio.fail_after(30):
            while len(seen) < len(sent):
                for rec in await c.receive():
                    seen[rec.queue_id, rec.queue_offset] = rec
    assert set(seen) == {(r[0], r[1]) for r in sent}
    # idempotence is on by default: each batch's first message carries "pid epoch first_seq last_seq",
    # and the sequences of each partition's batches cover its records, one producer per codec
    batches = [
        (k[0], *map(int, rec.properties[PROP_KAFKA_PRODUCER].split()))
        for k, rec in seen.items()
        if PROP_KAFKA_PRODUCER in (rec.properties or {})
    ]
    assert len({pid for _p, pid, *_ in batches}) == len(CODECS), batches[:5]
    assert all(pid >= 0 and epoch == 0 for _p, pid, epoch, *_ in batches)
    assert Counter(p for p, *_ in sent) == Counter({p: 0 for p in ends}) + Counter(
        {p: sum(last - first + 1 for q, _pid, _e, first, last in batches if q == p) for p in ends}
    )
    assert all(seen[p, o].body == v for p, o, _k, v, _t, _h in sent if v is not None), "clmq reads other bodies"

    # the committed offsets hold: the group resumes after them, with only what came since
    more = [_record(PER_CODEC + i, "late") for i in range(30)]
    late = await run_harness(harness, "produce", kafka.bootstrap, "java", "zstd", stdin=_lines(more))
    assert late.rc == 0, late.stderr[-3000:]
    again = await run_harness(harness, "consume", kafka.bootstrap, "java", "java-readers", str(len(more)))
    assert again.rc == 0, f"{again.facts}\n{again.stderr[-3000:]}"
    assert sorted(again.rows) == sorted(late.rows)

    # without a group: bounds, ListOffsets by timestamp (a time only the late records reach:
    # clmq searches by time assuming timestamps mostly grow), a seek and a fetch there
    everything = sent + late.rows
    target = min(r[4] for r in late.rows)
    ends = {p: max(r[1] for r in everything if r[0] == p) + 1 for p in ends}
    seek = await run_harness(harness, "seek", kafka.bootstrap, "java", str(target))
    assert seek.rc == 0, f"{seek.facts}\n{seek.stderr[-3000:]}"
    firsts = [min((r for r in late.rows if r[0] == p), key=lambda r: r[1], default=None) for p in sorted(ends)]
    for p, end in ends.items():
        assert seek.fact(f"bounds {p}") == f"0 {end}"
        first = firsts[p]
        assert seek.fact(f"for.time {p}") == ("none" if first is None else f"{first[1]} {first[4]}"), p
    assert sorted(seek.rows) == sorted(r for r in firsts if r is not None)


def _java_map(m: dict[int, int]) -> str:
    """A Java TreeMap's toString: {0=5, 1=7}."""
    return "{" + ", ".join(f"{k}={v}" for k, v in sorted(m.items())) + "}"


async def test_java_admin_client_topics_and_groups(kafka: KafkaCluster, harness: list[str]) -> None:
    run = await run_harness(harness, "admin", kafka.bootstrap, "adm", "adm-group")
    assert run.rc == 0, f"{run.facts}\n{run.stderr[-3000:]}"
    nodes = run.facts["cluster.node"]
    assert len(nodes) == 1 and nodes[0].endswith(kafka.kafka_addr("b0")), nodes
    node_id = nodes[0].split()[0]
    assert run.fact("cluster.controller") == node_id
    assert run.fact("cluster.id")
    assert run.fact("listed") == "true"
    assert run.fact("describe.before.name") == "adm" and run.fact("describe.before.internal") == "false"
    assert run.fact("describe.before.partitions") == "2"
    assert run.fact("describe.before.leaders") == f"[0:{node_id}:1:1, 1:{node_id}:1:1]"
    assert run.fact("describe.after.partitions") == "5"
    assert run.fact("describe.after.id") == run.fact("describe.before.id") != "AAAAAAAAAAAAAAAAAAAAAA"
    assert run.fact("shrink") == "InvalidPartitionsException"
    assert run.fact("describe.by.id") == "adm 2"  # Metadata by topic id
    assert run.fact("config cleanup.policy") == "delete"
    assert run.fact("config message.timestamp.type") == "CreateTime"
    assert run.fact("config compression.type") == "producer"
    assert int(run.fact("config retention.ms")) > 0 and int(run.fact("config max.message.bytes")) > 0
    assert int(run.fact("broker.configs")) > 0, run.fact("broker.configs")
    assert run.fact("group.read") == "10"
    assert run.fact("group.live.state") == "Stable" and run.fact("group.live.members") == "1"
    assert run.fact("group.live.assignment") == "[0, 1, 2, 3, 4]"
    assert run.fact("group.live.coordinator") == node_id
    assert run.fact("groups.listed") == "true"
    assert run.fact("group.state") == "Empty" and run.fact("group.members") == "0"
    assert run.fact("group.offsets") == "{0=2, 1=2, 2=2, 3=2, 4=2}"
    assert run.fact("groups.listed.after.delete") == "false"
    assert run.fact("group.delete.again") == "GroupIdNotFoundException"
    assert run.fact("listed.after.delete") == "false"
    assert run.fact("describe.after.delete") == "UnknownTopicOrPartitionException"


async def test_java_transactional_producer_is_refused_with_the_reason(kafka: KafkaCluster, harness: list[str]) -> None:
    await registered(kafka.namesrv)
    async with open_admin([kafka.namesrv]) as admin:
        await admin.create_topic("tx", 1)
    with trio.fail_after(15):  # well before the client's max.block.ms (20 s): not a timeout
        run = await run_harness(harness, "transactional", kafka.bootstrap, "tx")
    assert run.rc == 1, run.stdout
    errors = "\n".join(run.facts.get("error", []))
    # initTransactions fails at once (FindCoordinator for a transaction), with the broker's reason
    assert "coordinator with type TRANSACTION" in errors, f"{errors}\n{run.stderr[-3000:]}"
    assert "clmq's Kafka listener does not support transactions" in errors, f"{errors}\n{run.stderr[-3000:]}"
    assert "use an idempotent producer" in errors


async def test_java_client_logs_in_with_scram_and_is_held_to_its_acls(
    tmp_path: Path, harness: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kafka's own Java client with its usual SASL settings (SASL_PLAINTEXT,
    SCRAM-SHA-512, a JAAS line): alice may write and read topic "j" in group "jg";
    writing to "other" is refused by the ACLs, and nothing reaches it."""
    acls = [
        AclBinding("TOPIC", "j", "LITERAL", "User:alice", "*", "WRITE", "ALLOW"),
        AclBinding("TOPIC", "j", "LITERAL", "User:alice", "*", "READ", "ALLOW"),
        AclBinding("GROUP", "jg", "LITERAL", "User:alice", "*", "READ", "ALLOW"),
    ]
    props = tmp_path / "client.properties"
    props.write_text(
        "security.protocol=SASL_PLAINTEXT\n"
        "sasl.mechanism=SCRAM-SHA-512\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="alice" password="alice-secret";\n'
    )
    monkeypatch.setenv("HARNESS_CLIENT_PROPERTIES", str(props))
    async with open_secure_kafka(tmp_path / "kafka", acls=acls) as cluster:
        with wire_as(cluster, "admin") as w:
            create_topics(w, "j", "other")
        records = [_record(i, "none") for i in range(50)]
        run = await run_harness(harness, "produce", cluster.bootstrap, "j", "none", stdin=_lines(records))
        assert run.rc == 0, f"{run.facts}\n{run.stderr[-3000:]}"
        assert len(run.rows) == 50
        read = await run_harness(harness, "consume", cluster.bootstrap, "j", "jg", "50")
        assert read.rc == 0, f"{read.facts}\n{read.stderr[-3000:]}"
        assert sorted(read.rows) == sorted(run.rows)
        refused = await run_harness(harness, "produce", cluster.bootstrap, "other", "none", stdin=_lines(records[:1]))
        assert refused.rc != 0 and "TopicAuthorizationException" in refused.stdout + refused.stderr, refused.stderr[
            -2000:
        ]
        with wire_as(cluster, "admin") as w:
            assert end_offset(w, "other") == 0
