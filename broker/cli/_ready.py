"""What ``clmq dev`` prints once it serves: a first command that works as printed, the
command that reads its message back, and the metrics URLs; with ``-o json`` the same
as one JSON object (the addresses a script needs)."""

from __future__ import annotations

import argparse
from typing import Any

from ._dev_tls import print_tls_ready, tls_ready
from ._output import console, is_json, write_json

DEV_TOPIC, DEV_TOPIC_QUEUES = "demo", 4  # the topic of clmq dev's first command (and of --demo)


def metrics_url(host: str, port: int, tls: bool = False) -> str:
    """The Prometheus endpoint of a service serving metrics on ``port`` ("" if none)."""
    return f"{'https' if tls else 'http'}://{host}:{port}/metrics" if port >= 0 else ""


def first_command(namesrv: str) -> str:
    """Create the topic and send to it: works on a fresh ``clmq dev`` and again later
    (creating a topic with its queue count is a no-op; ``topic create`` returns once
    the name servers route it, so the produce finds it)."""
    ns = f"--namesrv {namesrv}"
    return f"clmq topic create {DEV_TOPIC} --queues {DEV_TOPIC_QUEUES} {ns} && clmq produce {DEV_TOPIC} hello {ns}"


def read_back_command(namesrv: str) -> str:
    """Read one message of the topic back, committing nothing (no ``--group``)."""
    return f"clmq consume {DEV_TOPIC} --count 1 --namesrv {namesrv}"


def print_ready(args: argparse.Namespace, namesrv: str, brokers: list[dict[str, Any]], data_dir: str) -> None:
    """The ready block for people (``brokers``: addr, broker_id, metrics_url), or one
    JSON object with ``-o json``. ``clmq dev --tls`` (``args.dev_certs``): how clients
    connect (the CA, the variables to export, a kcat line)."""
    kafka = ",".join(b["kafka_addr"] for b in brokers if b.get("kafka_addr"))
    certs = getattr(args, "dev_certs", None)
    tls = tls_ready(certs, kafka) if certs is not None else None
    if is_json(args):
        write_json(
            {
                "namesrv": namesrv,
                "brokers": brokers,
                "data_dir": data_dir,
                "metrics_url": brokers[0]["metrics_url"] if brokers else "",
                "first_command": first_command(namesrv),
                "read_back_command": read_back_command(namesrv),
                **({"tls": tls} if tls is not None else {}),
            }
        )
    if tls is not None:
        print_tls_ready(tls)
    if kafka:
        console.print(f"Kafka clients: bootstrap.servers={kafka}", highlight=False)
    for b in brokers:
        if b["metrics_url"]:
            label = "metrics:" if len(brokers) == 1 else f"metrics of replica {b['broker_id']}:"
            console.print(f"{label} {b['metrics_url']}", highlight=False)
    console.print(f"first command: {first_command(namesrv)}", highlight=False)
    console.print(f"read it back:  {read_back_command(namesrv)}", highlight=False)
