"""Brokers with a Kafka listener, as real processes, for the tests that judge the
listener with real Kafka clients (``test_kafka_*.py``).

:func:`open_kafka` starts a name server and one broker (group ``g``) with
``kafka_listen_port`` set, on top of ``replica_procs.py``; the yielded
:class:`KafkaCluster` knows the Kafka bootstrap address and the name server's
address (for clmq's own clients). Kafka clients run in worker threads
(:func:`in_thread`): confluent-kafka and kafka-python block.
"""

from __future__ import annotations

import shutil
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

import trio

from clmq.client import open_admin
from clmq.protocol.auth import SECURITY_FILE, AclBinding, SecurityState, make_credential, save_security
from tests.waiting import await_until

from .replica_procs import Broker, Group, free_port, open_group

T = TypeVar("T")

KCAT = shutil.which("kcat") or "kcat"
# A fast group coordinator for tests: no initial rebalance delay, short sessions allowed.
KAFKA_DEFAULTS: dict[str, Any] = {
    "kafka_group_initial_rebalance_delay_ms": 0,
    "kafka_group_min_session_timeout_ms": 1000,
    "auto_create_topics": False,
}


@dataclass
class KafkaCluster:
    group: Group
    brokers: dict[str, tuple[Broker, int]]  # key -> (broker, Kafka port)

    @property
    def bootstrap(self) -> str:
        """Every broker's Kafka address, comma-separated (bootstrap.servers)."""
        return ",".join(f"127.0.0.1:{port}" for _b, port in self.brokers.values())

    def kafka_addr(self, key: str) -> str:
        return f"127.0.0.1:{self.brokers[key][1]}"

    @property
    def namesrv(self) -> str:
        return self.group.ns_addr

    async def start_broker(self, key: str, broker_id: int = 0, **settings: Any) -> Broker:
        """Start (or add) broker ``key`` with a Kafka listener on a port of its own."""
        port = free_port()
        broker = await self.group.start_broker(
            key, broker_id, **{**KAFKA_DEFAULTS, "kafka_listen_port": port, **settings}
        )
        self.brokers[key] = (broker, port)
        return broker


@asynccontextmanager
async def open_kafka(root: Path, **settings: Any) -> AsyncIterator[KafkaCluster]:
    """A name server and one broker ``b0`` with its Kafka listener, under ``root``."""
    async with open_group(root) as group:
        cluster = KafkaCluster(group, {})
        await cluster.start_broker("b0", **settings)
        yield cluster


async def registered(namesrv: str, count: int = 1) -> None:
    """Wait until the name server at ``namesrv`` knows ``count`` brokers: before a clmq
    client that finds brokers there (a CI run asked before the broker's first
    registration and was told no broker was known)."""
    async with open_admin([namesrv]) as admin:

        async def listed() -> bool:
            return len(await admin.brokers()) >= count

        await await_until(listed, 15, f"{count} broker(s) registered with the name server")


SUPER_USER = "admin"
PASSWORDS = {"admin": "admin-secret", "alice": "alice-secret", "bob": "bob-secret"}
SCRAM_ITERATIONS = 4096  # the floor: fast tests


def security_state(passwords: dict[str, str], acls: Sequence[AclBinding] = ()) -> SecurityState:
    """Users (SCRAM-SHA-256 and -512 credentials of each password) and ACLs."""
    state = SecurityState()
    for user, password in passwords.items():
        creds = [make_credential(m, password, iterations=SCRAM_ITERATIONS) for m in ("SCRAM-SHA-256", "SCRAM-SHA-512")]
        state = state.with_user(user, creds)
    return state.with_acls(list(acls)) if acls else state


@asynccontextmanager
async def open_secure_kafka(
    root: Path, passwords: dict[str, str] | None = None, acls: Sequence[AclBinding] = (), **settings: Any
) -> AsyncIterator[KafkaCluster]:
    """Like :func:`open_kafka`, with ``auth_enabled``: the users of ``passwords``
    (default :data:`PASSWORDS`) written to the broker's ``security.json`` before it
    starts, ``User:admin`` a super user, and ``acls``."""
    data_dir = root / "b0"
    data_dir.mkdir(parents=True, exist_ok=True)
    save_security(data_dir / SECURITY_FILE, security_state(PASSWORDS if passwords is None else passwords, acls))
    conf = {"auth_enabled": True, "super_users": [f"User:{SUPER_USER}"], "auth_failure_delay_ms": 300, **settings}
    async with open_kafka(root, **conf) as cluster:
        yield cluster


def sasl_conf(user: str, mechanism: str = "SCRAM-SHA-256", password: str | None = None) -> dict[str, str]:
    """librdkafka's (confluent-kafka's, kcat's) settings to log in as ``user``."""
    return {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": mechanism,
        "sasl.username": user,
        "sasl.password": PASSWORDS.get(user, "") if password is None else password,
    }


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """A blocking Kafka client call, off the event loop (cancellable: abandoned)."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


async def kcat(*args: str, stdin: bytes = b"", timeout_s: float = 30) -> str:
    """Run kcat; its stdout (stderr joined into the assertion message on failure)."""
    with trio.fail_after(timeout_s):
        done = await trio.run_process([KCAT, *args], stdin=stdin, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, f"kcat {' '.join(args)} exited {done.returncode}: {done.stderr.decode()[-2000:]}"
    return done.stdout.decode(errors="replace")
