"""Write ``protocol/kafka/_schemas.py``: the Kafka message schemas clmq speaks, as data tables.

Usage::

    .venv/bin/python scripts/gen_kafka_schemas.py [KAFKA_GIT_DIR] [-o OUTPUT]

``KAFKA_GIT_DIR`` is a git directory of Apache Kafka (a bare mirror will do; default
``/work/.mirror/apache+kafka/repo``): the JSON message definitions are read at its HEAD
with ``git show``, so no work tree is needed. Only names, types, version ranges and
defaults are kept; the descriptions ("about") are not copied.

Table layout (read by ``clmq.protocol.kafka._schema``)::

    MESSAGES[api_key] = (name, request, response)
    message  = (valid_versions, flexible_versions, latest_version_unstable, fields)
    field    = (name, type, versions, nullable_versions, tag, tagged_versions,
                default, flexible_versions, fields)

A version range is ``(low, high)`` (``high`` 32767 for "N+") or ``None`` for "none".
``type`` is Kafka's type name (``int32``, ``string``, ``[]int32``, ``[]Topic``, ``Topic``);
``fields`` holds a struct's (or array of structs') own fields, common structs inlined.
``default`` is the JSON default string or ``None``; ``flexible_versions`` is a field's own
override (only the request header's ClientId has one: ``()``, "none") or ``None``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

DEFAULT_KAFKA = "/work/.mirror/apache+kafka/repo"
MESSAGE_DIR = "clients/src/main/resources/common/message"
OUTPUT = Path(__file__).resolve().parents[1] / "protocol" / "kafka" / "_schemas.py"
OPEN_END = 0x7FFF

# The APIs clmq's Kafka listener speaks (key: name).
APIS: dict[int, str] = {
    0: "Produce",
    1: "Fetch",
    2: "ListOffsets",
    3: "Metadata",
    8: "OffsetCommit",
    9: "OffsetFetch",
    10: "FindCoordinator",
    11: "JoinGroup",
    12: "Heartbeat",
    13: "LeaveGroup",
    14: "SyncGroup",
    15: "DescribeGroups",
    16: "ListGroups",
    17: "SaslHandshake",
    18: "ApiVersions",
    19: "CreateTopics",
    20: "DeleteTopics",
    22: "InitProducerId",
    23: "OffsetForLeaderEpoch",
    24: "AddPartitionsToTxn",
    25: "AddOffsetsToTxn",
    26: "EndTxn",
    28: "TxnOffsetCommit",
    29: "DescribeAcls",
    30: "CreateAcls",
    31: "DeleteAcls",
    32: "DescribeConfigs",
    36: "SaslAuthenticate",
    37: "CreatePartitions",
    42: "DeleteGroups",
    60: "DescribeCluster",
    61: "DescribeProducers",
    # Share groups (KIP-932): versions 1-2, read from OVERRIDES (see there).
    76: "ShareGroupHeartbeat",
    78: "ShareFetch",
    79: "ShareAcknowledge",
}

# Definitions read from this folder instead of the Kafka tree: the share group APIs, whose
# stable versions (1+, Kafka 4.1) are newer than the stored Kafka commit (which has only the
# early-access v0). Each file was transcribed from the compiled schemas (``SCHEMAS``) of
# org.apache.kafka:kafka-clients 4.4.0, the client the tests judge with.
OVERRIDES = Path(__file__).resolve().parent / "kafka_messages"


def git(kafka: str, *args: str) -> str:
    """The output of a git command run on the Kafka git directory."""
    return subprocess.run(["git", "-C", kafka, *args], check=True, capture_output=True, text=True).stdout


def load(kafka: str, name: str) -> dict[str, Any]:
    """One message definition, its ``//`` comment lines dropped (the files are JSON with comments)."""
    override = OVERRIDES / f"{name}.json"
    text = override.read_text() if override.is_file() else git(kafka, "show", f"HEAD:{MESSAGE_DIR}/{name}.json")
    kept = [line for line in text.splitlines() if not line.lstrip().startswith("//")]
    spec: dict[str, Any] = json.loads("\n".join(kept))
    return spec


def versions(text: str | None) -> tuple[int, int] | None:
    """``"3+"`` → (3, 32767), ``"0-7"`` → (0, 7), ``"5"`` → (5, 5), ``"none"``/absent → None."""
    if text is None or text == "none":
        return None
    if text.endswith("+"):
        return (int(text[:-1]), OPEN_END)
    low, _, high = text.partition("-")
    return (int(low), int(high or low))


def flexible_override(text: str | None) -> tuple[int, ...] | None:
    """A field's own flexibleVersions: None when it has none, ``()`` for "none", else a range."""
    if text is None:
        return None
    return versions(text) or ()


def snake(name: str) -> str:
    """``TopicName`` → ``topic_name``, ``ZkMigrationReady`` → ``zk_migration_ready``, ``ISRNodes`` → ``isr_nodes``."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def field_row(field: dict[str, Any], common: dict[str, list[dict[str, Any]]]) -> tuple[Any, ...]:
    """One field as a table row (see the module docstring), nested structs resolved."""
    kind = field["type"]
    element = kind[2:] if kind.startswith("[]") else kind
    children = field.get("fields")
    if children is None and element in common:
        children = common[element]
    default = field.get("default")
    return (
        snake(field["name"]),
        kind,
        versions(field["versions"]),
        versions(field.get("nullableVersions")),
        field.get("tag"),
        versions(field.get("taggedVersions")),
        None if default is None else str(default).lower() if isinstance(default, bool) else str(default),
        flexible_override(field.get("flexibleVersions")),
        None if children is None else tuple(field_row(child, common) for child in children),
    )


def message_row(spec: dict[str, Any]) -> tuple[Any, ...]:
    """A message (or header) definition as a table row."""
    common = {struct["name"]: struct["fields"] for struct in spec.get("commonStructs", [])}
    return (
        versions(spec["validVersions"]),
        versions(spec["flexibleVersions"]),
        bool(spec.get("latestVersionUnstable", False)),
        tuple(field_row(field, common) for field in spec["fields"]),
    )


def render(kafka: str) -> str:
    """The text of the generated module."""
    commit = git(kafka, "rev-parse", "HEAD").strip()
    lines = [
        "# Generated by scripts/gen_kafka_schemas.py from Apache Kafka's message definitions",
        f"# ({MESSAGE_DIR}/*.json,",
        f"# Kafka commit {commit}). Do not edit: rerun",
        "#     .venv/bin/python scripts/gen_kafka_schemas.py [KAFKA_GIT_DIR]",
        "# Layout: see that script's docstring. Kafka is licensed under the Apache License 2.0.",
        '"""Kafka message schemas as data tables (generated; read by ``_schema``)."""',
        "",
        "from typing import Any",
        "",
        f"KAFKA_COMMIT = {commit!r}",
        "",
        f"REQUEST_HEADER: tuple[Any, ...] = {message_row(load(kafka, 'RequestHeader'))!r}",
        f"RESPONSE_HEADER: tuple[Any, ...] = {message_row(load(kafka, 'ResponseHeader'))!r}",
        "",
        "MESSAGES: dict[int, tuple[Any, ...]] = {",
    ]
    for key, name in APIS.items():
        request, response = load(kafka, f"{name}Request"), load(kafka, f"{name}Response")
        assert request["apiKey"] == key == response["apiKey"], name
        lines.append(f"    {key}: ({name!r}, {message_row(request)!r}, {message_row(response)!r}),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def ruff_format(text: str) -> str:
    """The text as ``ruff format`` lays it out (the project's style; one field a line where it is long)."""
    ruff = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "ruff"
    command = [str(ruff) if ruff.exists() else "ruff", "format", "--stdin-filename", "_schemas.py", "-"]
    return subprocess.run(command, input=text, check=True, capture_output=True, text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kafka", nargs="?", default=DEFAULT_KAFKA, help="Kafka git directory (default: %(default)s)")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT, help="where to write (default: %(default)s)")
    args = parser.parse_args()
    args.output.write_text(ruff_format(render(args.kafka)))


if __name__ == "__main__":
    main()
