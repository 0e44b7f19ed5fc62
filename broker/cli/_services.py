"""The service commands of ``clmq``: dev, nameserver, broker. Settings come from a TOML
file, then ``CLMQ_*`` environment variables, then flags (``settings.py``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import trio

from clmq.broker.service import BrokerConfig
from clmq.broker.service import serve as serve_broker
from clmq.nameserver import NameServerConfig
from clmq.nameserver import serve as serve_nameserver

from ._common import NAMESRV_HELP, deprecated_alias, listen_port_arg
from ._errors import EXIT_USAGE, CliError, innermost
from ._output import add_output_arg, console, is_json, write_json
from ._progress import show_catch_up, start_progress
from ._ready import DEV_TOPIC, DEV_TOPIC_QUEUES, print_ready
from ._ready import metrics_url as _metrics_url
from .replication_verbs import add_status_args, cmd_broker_status
from .settings import load_settings


def add_commands(sub: Any) -> None:
    """Add the service commands (and the client verbs) to the ``clmq`` parser."""
    from ._client_verbs import add_client_commands

    add_service_commands(sub)
    add_client_commands(sub)


def add_service_commands(sub: Any) -> None:
    """Add ``clmq dev``, ``clmq nameserver`` and ``clmq broker`` (``main.py`` adds the
    client verbs apart, so that each imports only its own modules)."""
    _add_dev(sub)
    ns = sub.add_parser("nameserver", help="run a name server")
    ns.add_argument("--config", type=Path, help="TOML file (keys: NameServerConfig fields, or a [nameserver] table)")
    ns.add_argument("--listen-host", help="address to listen on (default 127.0.0.1)")
    ns.add_argument("--listen-port", type=listen_port_arg, help="port to listen on (default 9876; 0: any free)")
    ns.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on GET /metrics at this port (0: any free)"
    )
    for field, kind, helptext in TLS_FLAGS:
        ns.add_argument("--" + field.replace("_", "-"), dest=field, type=kind, help=helptext)
    add_output_arg(ns)
    ns.set_defaults(func=cmd_nameserver)
    _add_broker(sub)


def _add_dev(sub: Any) -> None:
    dev = sub.add_parser(
        "dev",
        help="name server and broker in one process, on a local data directory; the broker "
        "takes the settings of 'clmq broker' (--config, CLMQ_* variables, flags)",
    )
    dev.add_argument("--config", type=Path, help="TOML file (keys: BrokerConfig fields, or a [broker] table)")
    dev.add_argument("--data-dir", help="broker data directory (default ./clmq-data)")
    dev.add_argument("--listen-port", type=listen_port_arg, help="broker port (default 10911; 0: any free)")
    deprecated_alias(dev, "--port", "--listen-port", "listen_port", type=listen_port_arg)
    dev.add_argument("--storage-mode", help="commitlog (default) or partition-per-file")
    dev.add_argument("--flush-mode", help="async (default) or sync: acknowledge only once fsynced")
    dev.add_argument(
        "--metrics-port",
        type=int,
        help="the broker's Prometheus metrics port, GET /metrics (default 0: any free port, printed; -1: none)",
    )
    dev.add_argument("--namesrv-port", type=listen_port_arg, default=9876, help="name server port (default 9876)")
    dev.add_argument(
        "--kafka-port",
        dest="kafka_listen_port",
        type=int,
        help="serve Kafka's protocol on this port too, e.g. 9092 (docs/kafka.md; 0: any free; default: none)",
    )
    dev.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="brokers in the group (default 1: one broker in this "
        "process); N > 1: a leader and N-1 followers, each a separate process with its own data "
        "directory (<data-dir>/replica-<id>) and port (--listen-port + id)",
    )
    dev.add_argument(
        "--groups",
        type=int,
        default=1,
        help="broker groups (default 1); G > 1: groups broker-a, broker-b, ... of --replicas each, every "
        "replica a separate process (<data-dir>/<broker name>/replica-<id>, port --listen-port + group * "
        "replicas + id); topic create spreads a topic's queues over them",
    )
    dev.add_argument("--ack-mode", help="async (default) or sync: acknowledge once every in-sync replica holds it")
    dev.add_argument(
        "--min-insync-replicas", type=int, help="sync acks: replicas (leader included) that must be in sync"
    )
    dev.add_argument(
        "--tls",
        action="store_true",
        help="TLS on every port, with a throw-away CA and certificates made in <data-dir>/tls/ "
        "(the ready block says how clients connect)",
    )
    dev.add_argument("--demo", action="store_true", help="create a topic, produce and consume a few messages")
    dev.add_argument("--exit-after-demo", action="store_true", help="stop once the demo has run")
    add_output_arg(dev)
    dev.set_defaults(func=cmd_dev)


def _add_broker(sub: Any) -> None:
    br = sub.add_parser(
        "broker", help="run a broker ('clmq broker status --addr host:port': one broker's replication state)"
    )
    br.add_argument(
        "action",
        nargs="?",
        choices=["status"],
        help="status: show the replication state of the broker at --addr instead of running one",
    )
    br.add_argument(
        "--config",
        type=Path,
        help="TOML file (keys: BrokerConfig fields, or a [broker] table); every "
        "field can also be set as CLMQ_<FIELD> in the environment, e.g. CLMQ_MAX_CONNECTIONS=5000 "
        "(limits at the door: max_connections, reserved_file_descriptors, max_connection_buffer_bytes, "
        "max_buffered_request_bytes, frame_timeout_ms, idle_timeout_ms)",
    )
    for field, kind, helptext in BROKER_FLAGS:
        flag = "--" + FLAG_OF_SETTING.get(field, field.replace("_", "-"))
        br.add_argument(flag, dest=field, type=kind, help=helptext)
    deprecated_alias(br, "--namesrv-addrs", "--namesrv", "namesrv_addrs")
    add_status_args(br)
    br.set_defaults(func=cmd_broker)


async def _until_signal(
    stop: Callable[[], object], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Call ``stop`` (what it returns is of no use) at the first SIGINT or SIGTERM; started
    once the signals are caught, so that a Ctrl-C after the service says it runs stops it
    gracefully."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            console.print("stopping (graceful; a second Ctrl-C does not hurry it)")
            stop()
            return


def cmd_nameserver(args: argparse.Namespace) -> int:
    overrides = {"listen_host": args.listen_host, "listen_port": args.listen_port, "metrics_port": args.metrics_port}
    overrides |= {field: getattr(args, field) for field, _, _ in TLS_FLAGS}
    cfg = load_settings(NameServerConfig, args.config, section="nameserver", overrides=overrides)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ns = await nursery.start(serve_nameserver, cfg)
            await nursery.start(_until_signal, ns.shutdown)
            metrics = _metrics_url(cfg.metrics_bind_host, ns.metrics_port, cfg.tls_settings() is not None)
            console.print(f"name server on {ns.addr}" + (f"; metrics on {metrics}" if metrics else ""))
            if is_json(args):
                write_json({"addr": ns.addr, "metrics_url": metrics})

    return _run_service(main, f"{cfg.listen_host}:{cfg.listen_port}")


# TLS (docs/security.md#tls), the same flags on the broker and the name server; each also a
# TOML key and a CLMQ_<FIELD> variable.
TLS_FLAGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("tls_cert_file", str, "TLS: this server's certificate (PEM); with --tls-key-file every port speaks only TLS"),
    ("tls_key_file", str, "TLS: the key of --tls-cert-file (PEM)"),
    ("tls_ca_file", str, "TLS: the CA that peers' certificates chain to (client certificates, other brokers')"),
    ("tls_require_client_cert", str, "TLS: true: mutual TLS, clients must present a certificate of --tls-ca-file"),
    ("tls_min_version", str, "TLS: the lowest version accepted, 1.2 (default) or 1.3"),
)


# The broker's flags: each one a BrokerConfig field (also settable in the TOML file and as
# CLMQ_<FIELD>), named --<field> with dashes unless FLAG_OF_SETTING names it otherwise.
BROKER_FLAGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("broker_name", str, "the group: brokers with the same name replicate one log"),
    ("listen_host", str, "address to listen on (default 127.0.0.1)"),
    ("listen_port", listen_port_arg, "port to listen on (default 10911; 0: any free)"),
    ("metrics_port", int, "serve Prometheus metrics on GET /metrics at this port (0: any free; default -1: none)"),
    (
        "kafka_listen_port",
        int,
        "serve Kafka's protocol on this port too (docs/kafka.md; 0: any free; default -1: none)",
    ),
    ("data_dir", str, "data directory: the CommitLog, queues, offsets (default ./clmq-data)"),
    ("namesrv_addrs", str, NAMESRV_HELP.split(" (")[0] + " to register with (default 127.0.0.1:9876; '': none)"),
    ("storage_mode", str, "commitlog (default) or partition-per-file (one log per queue, Kafka's layout)"),
    ("flush_mode", str, "async (default: acknowledge once written) or sync (once fsynced)"),
    ("broker_id", int, "unique within the group"),
    ("role", str, "leader or follower, at the first start (later: the role kept in the data directory)"),
    ("leader_addr", str, "a follower's leader, host:port (default: the group's leader as the name servers know it)"),
    ("ack_mode", str, "async or sync: acknowledge a produce once every in-sync replica holds it"),
    ("topic_ack_modes", str, "per-topic ack mode: topic=sync,topic2=async"),
    ("min_insync_replicas", int, "sync writes are refused while fewer replicas (leader included) are in sync"),
    ("replica_ids", str, "ids allowed to replicate from this leader: 1,2 (default: any of the group)"),
    ("zookeeper", str, "automatic failover: host:port[,host:port...][/chroot] (role and leader-addr are then ignored)"),
    ("zk_session_timeout_ms", int, "a dead leader is replaced about this long after it stops answering (default 2s)"),
    ("unclean_leader_election", str, "true: elect an out-of-sync replica when no in-sync one is left (LOSES DATA)"),
    *TLS_FLAGS,
)
FLAG_OF_SETTING = {
    "namesrv_addrs": "namesrv",
    "kafka_listen_port": "kafka-port",
}  # one flag name per idea: --namesrv in every verb


def cmd_broker(args: argparse.Namespace) -> int:
    if args.action == "status":
        return cmd_broker_status(args)
    if args.addr:
        raise CliError("--addr belongs to 'clmq broker status'", EXIT_USAGE)
    keys = [field for field, _, _ in BROKER_FLAGS]
    cfg = load_settings(BrokerConfig, args.config, section="broker", overrides={k: getattr(args, k) for k in keys})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            with start_progress():  # a long recovery after a crash shows its progress
                broker = await nursery.start(serve_broker, cfg)
            nursery.start_soon(show_catch_up, broker.store)
            await nursery.start(_until_signal, broker.shutdown)
            console.print(
                f"broker {cfg.broker_name} on {broker.addr}, data in {cfg.data_dir} "
                f"({cfg.storage_mode}, {cfg.flush_mode} flush); name servers: {', '.join(cfg.namesrv_addrs) or 'none'}"
            )
            metrics = _metrics_url(cfg.metrics_bind_host, broker.metrics_port, cfg.tls_settings() is not None)
            if metrics:
                console.print(f"metrics on {metrics}")
            kafka = broker.kafka.kafka_addr() if broker.kafka is not None else ""
            if kafka:
                console.print(f"Kafka listener on {kafka}", highlight=False)
            if is_json(args):
                write_json(
                    {"addr": broker.addr, "broker_name": cfg.broker_name, "metrics_url": metrics, "kafka_addr": kafka}
                )
            _print_role(cfg, broker)

    return _run_service(main, f"{cfg.listen_host}:{cfg.listen_port}")


def _print_role(cfg: BrokerConfig, broker: Any) -> None:
    """The broker's place in its group: the role kept in the data directory wins over
    the setting, and ZooKeeper decides it when there is one."""
    acks = f"{cfg.ack_mode} acks, min_insync_replicas {cfg.min_insync_replicas}"
    if cfg.zookeeper:
        console.print(
            f"replica {cfg.broker_id} of group {cfg.broker_name}: its role comes from ZooKeeper "
            f"({cfg.zookeeper}, session {cfg.zk_session_timeout_ms} ms); {acks}"
        )
        return
    role = broker.replica.role
    where = (
        f" of {cfg.leader_addr or 'the leader the name servers know'}"
        if role == "follower"
        else f", epoch {broker.replica.epoch}"
    )
    console.print(f"replica {cfg.broker_id} of group {cfg.broker_name}: {role}{where}; {acks}")


def _run_service(main: Callable[[], Any], listen: str | None = None) -> int:
    """Run a service under trio; its errors (a locked data directory, a port taken)
    reach ``main``, which prints them as one line. ``listen``: the address it takes."""
    try:
        return int(trio.run(main) or 0)  # main may return an exit code
    except BaseException as e:
        err = innermost(e)
        if isinstance(err, OSError) and err.errno == errno.EADDRINUSE and "cannot listen on" in str(err):
            raise CliError(str(err.strerror)) from err
        if isinstance(err, OSError) and err.errno == errno.EADDRINUSE:
            raise CliError(
                f"cannot listen on {listen or 'its port'}: address already in use "
                "(another clmq, or another program, has it)"
            ) from err
        raise


# Under the file, the environment and the flags. Metrics on a free port: a dev broker
# shows its metrics URL without taking a port another program may hold.
DEV_DEFAULTS = {"register_interval_ms": 1000, "metrics_port": 0}


def cmd_dev(args: argparse.Namespace) -> int:
    """The broker's settings load as ``clmq broker``'s do (file, CLMQ_* variables,
    flags); only its name servers are set: the one this command runs."""
    # Here, not at the top: `clmq broker` and `nameserver` need none of it.
    from ._dev_tls import dev_client_env, with_dev_tls
    from .dev_groups import MAX_GROUPS
    from .dev_replicas import run_replica_group

    keys = (
        "listen_port",
        "data_dir",
        "storage_mode",
        "flush_mode",
        "ack_mode",
        "min_insync_replicas",
        "metrics_port",
        "kafka_listen_port",
    )
    base = load_settings(
        BrokerConfig,
        args.config,
        section="broker",
        defaults=DEV_DEFAULTS,
        overrides={k: getattr(args, k) for k in keys},
    )
    if args.replicas < 1:
        raise CliError(f"--replicas must be at least 1, got {args.replicas}", EXIT_USAGE)
    if not 1 <= args.groups <= MAX_GROUPS:
        raise CliError(f"--groups must be 1 to {MAX_GROUPS}, got {args.groups}", EXIT_USAGE)
    args.dev_certs = None
    if args.tls:  # a throw-away CA and certificates in <data-dir>/tls/, TLS on every port
        base, args.dev_certs = with_dev_tls(base)
        console.print(f"clmq dev: TLS with a throw-away CA, {args.dev_certs.ca.cert_file}", highlight=False)
    if getattr(args, "zookeeper", False) and args.replicas < 2:
        raise CliError("--zookeeper elects a group's leader: it needs --replicas 2 or more", EXIT_USAGE)
    with dev_client_env(args.dev_certs):  # this process's own clients (the demo, the waits) use TLS too
        if args.replicas > 1 or args.groups > 1:  # separate processes; this one runs the name server
            return _run_service(lambda: run_replica_group(args, base, _demo))

        return _run_service(
            lambda: _serve_dev(args, base),
            f"name server 127.0.0.1:{args.namesrv_port} or broker {base.listen_host}:{base.listen_port}",
        )


async def _serve_dev(args: argparse.Namespace, base: BrokerConfig) -> None:
    """``clmq dev`` in one process: the name server, then the broker registered with it."""
    from ._dev_tls import dev_nameserver_config

    async with trio.open_nursery() as nursery:
        ns = await nursery.start(serve_nameserver, dev_nameserver_config(args.namesrv_port, base))
        cfg = dataclasses.replace(base, namesrv_addrs=[ns.addr])
        broker = await nursery.start(serve_broker, cfg)
        console.print(
            f"clmq dev: name server {ns.addr}, broker {broker.addr}, data in {cfg.data_dir}/ "
            f"({cfg.storage_mode}, {cfg.flush_mode} flush)",
            highlight=False,
        )
        if args.demo:
            await _demo(ns.addr)
        if args.exit_after_demo:
            broker.shutdown()
            ns.shutdown()
            return
        await nursery.start(_until_signal, lambda: (broker.shutdown(), ns.shutdown()))
        url = _metrics_url(cfg.metrics_bind_host, broker.metrics_port, cfg.tls_settings() is not None)
        kafka = broker.kafka.kafka_addr() if broker.kafka is not None else ""
        ready = {"addr": broker.addr, "broker_id": 0, "metrics_url": url, "kafka_addr": kafka}
        print_ready(args, ns.addr, [ready], str(cfg.data_dir))
        console.print("serving; Ctrl-C stops")


async def _demo(namesrv: str) -> None:
    """Create a topic, send a few messages, consume them back as a group."""
    from clmq.client import open_admin, open_consumer, open_producer  # here: `clmq broker` needs no client

    async with open_admin([namesrv]) as admin:
        with trio.fail_after(10):
            while not await admin.brokers():  # noqa: ASYNC110 - a remote state: the name server has no watch
                await trio.sleep(0.05)
        with contextlib.suppress(ValueError):  # a topic grown past DEV_TOPIC_QUEUES already: kept as it is
            await admin.spread_topic(DEV_TOPIC, DEV_TOPIC_QUEUES)  # over every broker group, as the first command
    async with open_producer([namesrv]) as producer:
        sent = await _demo_send(producer)
    want = {f"k{i}" for i in range(len(sent))}  # by key: with --groups, queue ids and offsets repeat per group
    group = f"demo-{os.getpid()}-{time.time_ns()}"
    async with open_consumer([namesrv], group, {DEV_TOPIC: "*"}, start_from="earliest", pull_wait_ms=200) as consumer:
        with trio.move_on_after(10):
            while want:
                for rec in await consumer.receive():
                    if rec.keys in want:
                        want.discard(rec.keys)
                        console.print(
                            f"received queue {rec.queue_id} offset {rec.queue_offset} [{rec.tags}]: {rec.body.decode()}"
                        )
    console.print(
        "[green]messages flowed: produced 5, consumed 5[/green]"
        if not want
        else f"[red]{len(want)} messages not consumed[/red]"
    )
    async with open_admin([namesrv]) as admin:  # the demo's group has done its job: leave no group behind
        await admin.delete_group(group)


async def _demo_send(producer: Any) -> list[Any]:
    """Once the name server routes the demo topic: five messages, tagged TagA and TagB."""
    from clmq.client import NoRouteError

    with trio.fail_after(10):
        while True:
            try:
                await producer.routes.queues(DEV_TOPIC, refresh=True)
                break
            except NoRouteError:
                await trio.sleep(0.1)  # a remote state: the name server sends no notification
    stamp = time.strftime("%H:%M:%S")
    sent = []
    for i in range(5):
        body = f"hello #{i} at {stamp}".encode()
        r = await producer.send(DEV_TOPIC, body, tags="TagA" if i % 2 == 0 else "TagB", keys=f"k{i}")
        sent.append(r)
        where = f"queue {r.queue.queue_id} offset {r.queue_offset} on {r.queue.broker_name}"
        console.print(f"sent     {where}: hello #{i}")
    return sent
