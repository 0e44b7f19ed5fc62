"""``clmq bench startup``: what starting a ``clmq`` command costs before it does
anything: the wall time and CPU time of ``python -m clmq <command> --help`` and the time
its imports take (``python -X importtime``, summed), median of ``--runs``. Every test,
benchmark and ``clmq dev --replicas`` starts brokers and verbs as processes, so this is
paid per process. ``--against DIR`` runs the same commands from another checkout of
clmq too (e.g. ``git worktree add /tmp/before <commit>``), alternated with this one run
by run, so that both see the same load."""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

COMMANDS = ("--help", "broker --help", "produce --help", "dev --help", "bench e2e --help")


def add_command(bench_sub: Any) -> None:
    """Add ``clmq bench startup`` to the ``clmq bench`` parser."""
    p = bench_sub.add_parser("startup", help="start-up cost of clmq commands: wall, CPU and import time per process")
    p.add_argument(
        "--commands",
        type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
        default=list(COMMANDS),
        help="the commands, comma-separated (default: " + ",".join(COMMANDS) + ")",
    )
    p.add_argument("--runs", type=int, default=9, help="runs of each command, medians are reported (default 9)")
    p.add_argument(
        "--against",
        type=Path,
        default=None,
        help="another clmq checkout (its directory, holding clmq/): its start-up is measured too, alternated",
    )
    p.add_argument("--json", type=Path, default=None, help="where to write the JSON (default: in --out-dir)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    p.set_defaults(func=cmd_bench_startup)


def _root() -> Path:
    """The directory holding this clmq's ``clmq/`` package."""
    return Path(__file__).resolve().parents[1]


def run_once(tree: Path, words: list[str]) -> dict[str, float]:
    """One ``python -m clmq <words>`` from ``tree``: wall and CPU seconds, and one more
    process under ``-X importtime`` for the seconds its imports took."""
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "clmq", *words], cwd=tree, env=env, stdout=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    traced = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "clmq", *words],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=True,
    )
    return {"wall_s": wall, "cpu_s": cpu, "imports_s": import_seconds(traced.stderr)}


def import_seconds(importtime_output: str) -> float:
    """The sum of every module's own import time in ``-X importtime`` output."""
    total_us = 0
    for line in importtime_output.splitlines():
        if line.startswith("import time:"):
            own = line.split(":", 1)[1].split("|")[0].strip()
            total_us += int(own) if own.isdigit() else 0
    return total_us / 1e6


def trees_of(args: argparse.Namespace) -> dict[str, Path]:
    """This checkout, and ``--against``'s if given."""
    return {"this": _root()} | ({"against": args.against.resolve()} if args.against else {})


def run_all(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    """Every command from each tree, the trees alternated run by run; medians."""
    trees = trees_of(args)
    rows = []
    for command in args.commands:
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.runs):
            for name, tree in trees.items():
                samples[name].append(run_once(tree, command.split()))
        for name, runs in samples.items():
            row = {"command": f"clmq {command}", "tree": name, "path": str(trees[name]), "runs": len(runs)}
            row |= {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "cpu_s", "imports_s")}
            rows.append(row)
            say(_line(row))
    return {"bench": "startup", "python": sys.version.split()[0], "rows": rows}


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['command']} ({row['tree']}): wall {row['wall_s'] * 1000:.0f} ms, CPU {row['cpu_s'] * 1000:.0f} ms, "
        f"imports {row['imports_s'] * 1000:.0f} ms (median of {row['runs']})"
    )


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    lines = ["| command | tree | wall ms | CPU ms | imports ms |", "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(
            f"| `{r['command']}` | {r['tree']} | {r['wall_s'] * 1000:.0f} | {r['cpu_s'] * 1000:.0f} "
            f"| {r['imports_s'] * 1000:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Horizontal bars of CPU ms per command, one bar per checkout ("this", "against")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    commands = list(dict.fromkeys(r["command"] for r in rows))
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    height = 0.8 / len(trees)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(commands)))
    for k, tree in enumerate(trees):
        cpu = {r["command"]: r["cpu_s"] * 1000 for r in rows if r["tree"] == tree}
        ys = [i + (k - (len(trees) - 1) / 2) * height for i in range(len(commands))]
        ax.barh(ys, [cpu.get(c, 0.0) for c in commands], height, label=tree)
    ax.set_yticks(range(len(commands)), commands)
    ax.invert_yaxis()
    ax.set_xlabel(f"CPU ms per process (median of {rows[0]['runs']} runs)")
    ax.set_title("start-up of clmq commands")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_bench_startup(args: argparse.Namespace) -> int:
    """``clmq bench startup``."""
    from rich.console import Console

    from .report import save

    console = Console(soft_wrap=True)
    if args.runs < 1:
        console.print("clmq bench startup: --runs must be at least 1")
        return 2
    for tree in trees_of(args).values():
        if not (tree / "clmq" / "__init__.py").is_file():
            console.print(f"clmq bench startup: {tree} holds no clmq/ package (--against: a checkout of clmq)")
            return 2
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra
        plot(result, args.plot)
        console.print(f"plot written to {args.plot}")
    return 0
