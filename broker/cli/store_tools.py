"""``clmq store check DIR`` and ``clmq store repair DIR``: offline tools for a closed
store directory, in the spirit of Kafka's ``kafka-dump-log`` and ``fsck``; and ``clmq
store offsets --write-v1 DIR``, the consumer offsets file in the format of releases
before issue 34 (going back to one).

Exit codes (as ``fsck``): 0 the store is clean (or was repaired), 1 damage was found
(check) or left in place (repair declined), 2 the tool could not run (usage, not a
directory, the store is open in a broker).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from clmq.broker.store import (
    StoreConfig,
    StoreLockedError,
    StoreReport,
    check_store,
    detect_mode,
    log_bytes,
    repair_store,
    store_lock,
)
from clmq.commitlog import QueueRange, load_json, previous_path
from clmq.protocol.auth import SECURITY_FILE, SecurityState, load_security, save_security

from ._common import add_json_alias
from ._output import add_output_arg, console, is_json, print_table, to_terminal, write_json
from .settings import SettingsError, load_settings

EXIT_CLEAN, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2


def add_command(sub: Any) -> None:
    """Add ``clmq store check|repair|offsets`` to the ``clmq`` parser."""
    store = sub.add_parser("store", help="offline tools for a store directory (the broker must be stopped)")
    verbs = store.add_subparsers(dest="store_verb", required=True)
    check = verbs.add_parser("check", help="read every file of DIR and report damage (exit 1 if any)")
    repair = verbs.add_parser("repair", help="cut the log to its longest valid prefix; rebuild queues, indexes, topics")
    for p in (check, repair):
        p.add_argument("directory", type=Path, metavar="DIR", help="the store's data directory")
        add_output_arg(p)
        add_json_alias(p)
        p.add_argument("--config", type=Path, help="the broker's TOML file (segment and queue-file sizes)")
        p.add_argument(
            "--storage-mode", choices=("commitlog", "partition-per-file"), help="the store's layout (default: detected)"
        )
    repair.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    check.set_defaults(func=cmd_check)
    repair.set_defaults(func=cmd_repair)
    offsets = verbs.add_parser("offsets", help="convert the consumer offsets file (going back to an earlier release)")
    offsets.add_argument("directory", type=Path, metavar="DIR", help="the store's data directory")
    offsets.add_argument(
        "--write-v1", action="store_true", required=True, help="rewrite it as version 1 (releases before issue 34)"
    )
    add_output_arg(offsets)
    offsets.set_defaults(func=cmd_offsets)


def _config(args: argparse.Namespace) -> StoreConfig:
    """The store's settings: the broker's (file, CLMQ_* variables), the mode detected."""
    from clmq.broker.service import BrokerConfig

    broker = load_settings(BrokerConfig, args.config, section="broker")
    mode = args.storage_mode or detect_mode(args.directory)
    return dataclasses.replace(broker.store_config(), data_dir=args.directory, storage_mode=mode)


def _run(
    args: argparse.Namespace, action: Callable[[StoreConfig, Callable[[int], None] | None], StoreReport]
) -> StoreReport | int:
    """Run a check or repair with a progress bar (on a terminal); an int is an exit code."""
    try:
        config = _config(args)
    except SettingsError as e:
        console.print(f"[red]error:[/red] {e}")
        return EXIT_USAGE
    if not args.directory.is_dir():
        console.print(f"[red]error:[/red] {args.directory} is not a directory")
        return EXIT_USAGE
    logging.getLogger("clmq").setLevel(logging.ERROR)  # the report says it all, once
    try:
        if not to_terminal() or is_json(args):
            return action(config, None)
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("reading", total=log_bytes(args.directory))
            return action(config, lambda n: bar.advance(task, n))
    except StoreLockedError as e:
        console.print(f"[red]error:[/red] {e}")
        return EXIT_USAGE


def _security_content(value: Any) -> str | None:
    """Why a ``security.json`` generation cannot be loaded (as the broker would judge it), or None."""
    try:
        SecurityState.from_json(value)
    except ValueError as e:
        return str(e)
    return None


VALIDATORS = {SECURITY_FILE: _security_content}  # metadata whose content the storage layer cannot judge


def _check(config: StoreConfig, progress: Callable[[int], None] | None) -> StoreReport:
    return check_store(config, progress, VALIDATORS)


def _repair(config: StoreConfig, progress: Callable[[int], None] | None) -> StoreReport:
    report = repair_store(config, progress, VALIDATORS)
    path = config.data_dir / SECURITY_FILE
    if report.repaired and any(m.file == str(path) and m.state == "previous" for m in report.metadata):
        with store_lock(config.data_dir):  # the good previous generation written back as the current one
            save_security(path, load_security(path))
    return report


def _security_counts(report: StoreReport) -> dict[str, dict[str, int]]:
    """security.json's users and ACLs (of the generation a broker would use), by file;
    its detail in the report says them too."""
    counts = {}
    for i, m in enumerate(report.metadata):
        if Path(m.file).name != SECURITY_FILE or m.state not in ("ok", "previous"):
            continue
        state = load_security(Path(m.file))
        counts[m.file] = {"users": len(state.users), "acls": len(state.acls), "version": state.version}
        said = f"{len(state.users)} users, {len(state.acls)} ACLs (version {state.version})"
        detail = f"{m.detail}; previous generation: {said}" if m.detail else said
        report.metadata[i] = dataclasses.replace(m, detail=detail)
    return counts


def cmd_check(args: argparse.Namespace) -> int:
    report = _run(args, _check)
    if isinstance(report, int):
        return report
    _print(report, is_json(args))
    return EXIT_DAMAGED if report.damaged else EXIT_CLEAN


def cmd_repair(args: argparse.Namespace) -> int:
    if not args.yes:
        report = _run(args, _check)
        if isinstance(report, int):
            return report
        if not report.damaged:
            _print(report, is_json(args))
            return EXIT_CLEAN
        _print(report, json_out=False)
        answer = input("Repair: cut the log as above, rebuild queues, indexes and topics? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            console.print("nothing changed")
            return EXIT_DAMAGED
    repaired = _run(args, _repair)
    if isinstance(repaired, int):
        return repaired
    _print(repaired, is_json(args))
    return EXIT_CLEAN


def cmd_offsets(args: argparse.Namespace) -> int:
    """``clmq store offsets --write-v1 DIR``: consumer_offsets.json (both generations) as version 1."""
    from clmq.broker.service import write_offsets_version_1
    from clmq.common import MetadataError

    path = args.directory / "consumer_offsets.json"
    try:
        with store_lock(args.directory):
            written = write_offsets_version_1(path)
    except (StoreLockedError, FileNotFoundError, MetadataError) as e:
        console.print(f"[red]error:[/red] {e}")
        return EXIT_USAGE
    if is_json(args):
        write_json(_offsets_doc(args.directory, path, written))
    elif written is None:
        console.print(f"no consumer offsets in {args.directory}: nothing to convert")
    else:
        console.print(f"{path}: {written} committed offsets written as version 1 (both generations)")
    return EXIT_CLEAN


def _offsets_doc(directory: Path, path: Path, written: int | None) -> dict[str, Any]:
    """``store offsets -o json``: the files rewritten as version 1, their offsets and groups."""
    groups: list[str] = []
    if written is not None:  # both generations hold the same rows now: [group, topic, queue, offset]
        groups = sorted({row[0] for row in load_json(path).value["offsets"]})
    return {
        "directory": str(directory),
        "version": 1,
        "converted": written is not None,
        "files": [str(path), str(previous_path(path))] if written is not None else [],
        "offsets": written or 0,
        "groups": groups,
    }


# ------------------------------------------------------------------ output
def _print(report: StoreReport, json_out: bool) -> None:
    security = _security_counts(report)
    if json_out:
        doc = report.to_json()
        for m in doc["metadata"]:
            m.update(security.get(m["file"], {}))
        write_json(doc)
        return
    for log in report.logs[:1] if report.mode == "commitlog" else []:
        console.print(
            f"log {log.directory}: {log.segments} segments, {log.records:,} records, {log.bytes:,} bytes",
            markup=False,
            highlight=False,
        )
    if report.mode != "commitlog":
        console.print(f"{len(report.logs)} partitions, {sum(r.records for r in report.logs):,} records")
    _damage_table(report)
    _rows(
        "consume-queue files",
        ("file", "queue", "offsets", "what is wrong"),
        [(q.file, f"{q.topic}/{q.queue_id}", f"{q.first}..{q.last}", q.reason) for q in report.queue_problems],
    )
    _rows(
        "index files (rebuilt at open)", ("file", "what is wrong"), [(p.file, p.reason) for p in report.index_problems]
    )
    _rows("metadata files", ("file", "state", "detail"), [(m.file, m.state, m.detail) for m in report.metadata])
    _ranges(
        "a repair would drop" if not report.repaired else "dropped by the repair",
        report.dropped if report.repaired else report.would_drop,
    )
    if report.repaired:
        console.print("[green]repaired:[/green] the next open rebuilds queues, indexes and the checkpoint")
        if any(m.file.endswith("consumer_offsets.json") and m.state == "damaged" for m in report.metadata):
            console.print(
                "[yellow]consumer offsets cannot be rebuilt from the log:[/yellow] delete consumer_offsets.json "
                "and consumer_offsets.json.prev to start consumer groups from their configured start"
            )
        if any(Path(m.file).name == SECURITY_FILE and m.state == "damaged" for m in report.metadata):
            console.print(
                "[yellow]users and ACLs cannot be rebuilt from the log:[/yellow] restore security.json from a "
                "backup, or delete security.json and security.json.prev and add them again offline "
                "(clmq user add --data-dir, clmq acl add --data-dir)"
            )
    elif not report.damaged:
        console.print("[green]no damage found[/green]")
    else:
        console.print("[red]damage found[/red]: `clmq store repair` cuts the log to its longest valid prefix")


def _damage_table(report: StoreReport) -> None:
    rows = []
    for d in report.damage:
        cost = ", ".join(f"{r.topic}/{r.queue_id} {r.first}..{r.last} ({r.count})" for r in d.affected[:5])
        more = f" and {len(d.affected) - 5} more queues" if len(d.affected) > 5 else ""
        rows.append((d.problem.file, f"{d.problem.start}..{d.problem.end}", d.problem.reason, (cost or "-") + more))
    _rows("damaged log ranges", ("file", "range", "what is wrong", "messages there"), rows)


def _ranges(title: str, ranges: list[QueueRange]) -> None:
    if ranges:
        console.print(f"{title}: {sum(r.count for r in ranges):,} messages in {len(ranges)} queues")
    _rows(
        "",
        ("topic", "queue", "offsets", "count"),
        [(r.topic, str(r.queue_id), f"{r.first}..{r.last}", f"{r.count:,}") for r in ranges],
    )


def _rows(title: str, columns: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    if rows:
        print_table(title, columns, rows)
