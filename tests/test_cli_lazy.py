"""``clmq`` builds in full only the command it runs (``broker/cli/_lazy.py``): every
command's ``--help`` and every parse are the same as with the whole tree built, and a
command run in a real process imports only what it needs (``clmq broker`` no
benchmark, no client, no Kafka listener; ``clmq --help`` neither the broker nor the
client; a client verb no numpy)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.cli._lazy import chosen_command, parser_tree
from clmq.broker.cli.main import COMMANDS, build_parser
from tests.cli_helpers import ROOT

EAGER = build_parser()
TREE = parser_tree(EAGER)


@pytest.fixture(autouse=True)
def _fixed_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps help to the terminal's width


def test_every_commands_help_is_the_same_built_lazily() -> None:
    tree = parser_tree(build_parser())  # under the fixed width
    assert ("bench", "e2e") in tree and ("broker",) in tree and len(tree) > 60
    for path in tree:
        lazy = parser_tree(build_parser([*path, "--help"]))
        assert set(lazy) >= {path[:i] for i in range(len(path) + 1)}, path
        for i in range(len(path) + 1):  # the command's own help, and each listing above it
            assert lazy[path[:i]] == tree[path[:i]], (path, path[:i])


def test_the_table_names_every_command_of_the_whole_tree_in_order() -> None:
    listed = [name for verbs in COMMANDS for name in verbs.names]
    assert listed == [path[0] for path in TREE if len(path) == 1]


def test_the_command_is_the_first_word_naming_one() -> None:
    assert chosen_command(COMMANDS, ["-v", "--log-format", "json", "broker", "--listen-port", "0"]) == (
        "broker",
        ["--listen-port", "0"],
    )
    assert chosen_command(COMMANDS, ["produce", "store", "x"]) == ("produce", ["store", "x"])  # a topic named store
    assert chosen_command(COMMANDS, ["--help"]) == (None, [])
    assert chosen_command(COMMANDS, ["brokr"]) == (None, [])


def outcome(parser_of: Any, words: list[str]) -> tuple[Any, ...]:
    """What parsing ``words`` gives: the arguments, the exit code and what was printed,
    or the error raised."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return ("parsed", vars(parser_of(words).parse_args(words)))
    except SystemExit as e:
        return ("exit", e.code, out.getvalue(), err.getvalue())
    except Exception as e:  # a type= that raises CliError (main prints it as one line)
        return ("raised", type(e), str(e))


LEAVES = sorted(path for path in TREE if path and not any(p[: len(path)] == path and p != path for p in TREE))


def _options(path: tuple[str, ...]) -> list[str]:
    parser = EAGER
    for name in path:
        (subs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = subs.choices[name]
    return sorted({o for a in parser._actions for o in a.option_strings})


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    """A command line a person could type, right or wrong: top-level flags, a command's
    path (sometimes cut short), then its own options with values that fit or not."""
    path = list(draw(st.sampled_from(LEAVES)))
    path = path[: draw(st.integers(1, len(path)))]
    top_flags = ["-v", "--log-format", "json", "--log-level", "info", "--version"]
    top = draw(st.lists(st.sampled_from(top_flags), max_size=3))
    words = ["1", "0", "5s", "250ms", "x", "json", "--", "-o", "--help", "broker", "e2e", "store", "brokr"]
    rest = draw(st.lists(st.sampled_from(_options(tuple(path)) + words), max_size=6))
    return [*top, *path, *rest]


@settings(max_examples=150, deadline=None)
@given(command_lines())
def test_a_command_line_parses_the_same_built_lazily_or_whole(words: list[str]) -> None:
    assert outcome(build_parser, words) == outcome(lambda _: EAGER, words)


def modules_imported(*words: str) -> list[str]:
    """The clmq (and heavy third-party) modules a real ``clmq <words>`` process imports."""
    script = (
        "import sys, io, contextlib, json\n"
        "from clmq.broker.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    main({list(words)!r})\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def test_clmq_help_imports_neither_the_broker_nor_the_client_nor_rich() -> None:
    modules = modules_imported("--help")
    assert "clmq.broker.cli.main" in modules
    for heavy in ("clmq.broker.service", "clmq.client", "clmq.bench", "trio", "rich", "numpy"):
        assert heavy not in modules, heavy


def test_clmq_broker_imports_no_benchmark_no_client_and_no_certificates() -> None:
    modules = modules_imported("broker", "--help")
    assert "clmq.broker.service" in modules
    unwanted = ("clmq.bench", "clmq.client", "clmq.spark_connector", "clmq.devtools", "cryptography", "matplotlib")
    assert [m for m in modules if m.startswith(unwanted)] == []
    # The Kafka listener's modules: imported by a broker that has one (kafka_listen_port), only.
    assert [m for m in modules if m.startswith(("clmq.broker.service.kafka", "clmq.protocol.kafka"))] == []
    verbs = ("_client_verbs", "consume_verbs", "dashboard", "security_verbs", "export", "store_tools", "dev_replicas")
    for verb in verbs:
        assert f"clmq.broker.cli.{verb}" not in modules, verb


def test_a_benchmark_imports_only_its_own_module() -> None:
    modules = modules_imported("bench", "e2e", "--help")
    assert "clmq.bench.e2e" in modules
    for other in ("delay", "latency", "peers", "kafka", "spark", "failover", "pop", "trace", "index"):
        assert f"clmq.bench.{other}" not in modules, other


def test_a_client_verb_does_not_import_the_broker_service() -> None:
    modules = modules_imported("produce", "--help")
    assert "clmq.client" in modules
    assert [m for m in modules if m.startswith(("clmq.broker.service", "clmq.bench", "clmq.devtools"))] == []
    # numpy: imported when records are first decoded in columns (clmq.common's lazy names), not to start.
    assert "numpy" not in modules and "clmq.common._columns" not in modules


@pytest.mark.parametrize(("given", "expected"), [(None, "1"), ("3", "3")])
def test_a_clmq_process_starts_numpy_without_a_thread_per_core(given: str | None, expected: str) -> None:
    """``clmq`` sets ``OPENBLAS_NUM_THREADS=1`` before numpy is imported (its thread pool
    cost a broker ~70 ms of CPU at start, for linear algebra clmq never does), unless the
    environment sets it."""
    script = (
        "import os, io, contextlib\n"
        "from clmq.broker.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(os.environ['OPENBLAS_NUM_THREADS'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
