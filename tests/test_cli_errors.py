"""Every expected failure of ``clmq`` is one line on stderr with a documented exit code
(issue 18): bad addresses and ports for every verb, a port already taken, times that
are no time, Ctrl-C. Through the real CLI."""

from __future__ import annotations

import socket
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clmq.broker.cli._errors import EXIT_USAGE, CliError
from clmq.broker.cli._timefmt import format_time_ms, parse_time_ms
from tests.cli_helpers import clmq

CLIENT_VERBS = [
    ["topic", "list"],
    ["topic", "describe", "t"],
    ["topic", "create", "t"],
    ["group", "list"],
    ["group", "describe", "g"],
    ["produce", "t", "x"],
    ["consume", "t"],
    ["cluster", "list"],
]


def one_line_error(out: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert says in out.stderr, out.stderr


@pytest.mark.parametrize("verb", CLIENT_VERBS, ids=lambda v: " ".join(v))
@pytest.mark.parametrize("addr", ["localhost", "127.0.0.1:70000", "127.0.0.1:", ":9876", "127.0.0.1:x", ","])
def test_a_name_server_address_without_a_usable_port_is_a_usage_error(tmp_path, verb: list[str], addr: str) -> None:  # type: ignore[no-untyped-def]
    one_line_error(clmq(*verb, "--namesrv", addr, cwd=tmp_path), EXIT_USAGE, "")


@pytest.mark.parametrize(
    "command",
    [["nameserver", "--listen-port"], ["broker", "--listen-port"], ["dev", "--listen-port"], ["dev", "--namesrv-port"]],
)
@pytest.mark.parametrize("port", ["70000", "65536", "-1", "abc"])
def test_a_port_outside_the_range_is_a_usage_error(tmp_path, command: list[str], port: str) -> None:  # type: ignore[no-untyped-def]
    out = (
        clmq(*command, port, "--data-dir", str(tmp_path / "d"), cwd=tmp_path)
        if command[0] == "dev"
        else clmq(*command, port, cwd=tmp_path)
    )
    assert out.returncode == EXIT_USAGE and "Traceback" not in out.stderr, out
    assert not (tmp_path / "d").exists()  # nothing started


@pytest.mark.parametrize("service", ["nameserver", "broker"])
def test_a_port_already_taken_is_one_line(tmp_path, service: str) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        extra = ["--data-dir", str(tmp_path / "d"), "--namesrv", ""] if service == "broker" else []
        out = clmq(service, "--listen-port", port, *extra, cwd=tmp_path)
    one_line_error(out, 1, f"cannot listen on 127.0.0.1:{port}: address already in use")


def test_a_bad_setting_is_a_usage_error_naming_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    one_line_error(
        clmq("broker", "--config", str(tmp_path / "absent.toml"), cwd=tmp_path), EXIT_USAGE, "does not exist"
    )
    one_line_error(clmq("broker", "--flush-mode", "sometimes", cwd=tmp_path), EXIT_USAGE, "flush_mode")


# ---------------------------------------------------------------- time formats
NOW = 1_763_891_000_000


@given(
    amount=st.integers(0, 10_000),
    unit=st.sampled_from(["ms", "s", "m", "h", "d", "w"]),
    sign=st.sampled_from(["", "-"]),
)
def test_a_duration_ago_is_now_minus_it(amount: int, unit: str, sign: str) -> None:
    ms = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}[unit]
    assert parse_time_ms(f"{sign}{amount}{unit}", now_ms=NOW) == NOW - amount * ms


@given(ms=st.integers(1_000_000_000_000, 4_000_000_000_000))
def test_an_iso_time_printed_reads_back_and_epoch_ms_is_itself(ms: int) -> None:
    assert parse_time_ms(format_time_ms(ms)) == ms
    assert parse_time_ms(str(ms)) == ms


@given(text=st.text(max_size=20))
def test_anything_else_is_a_usage_error_or_a_time(text: str) -> None:
    try:
        parse_time_ms(text, now_ms=NOW)
    except CliError as e:
        assert e.exit_code == EXIT_USAGE and ("not understood" in str(e) or "too small" in str(e))


def test_the_store_demo_keeps_out_of_the_dev_data_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = clmq("demo", "--messages", "10", "--queues", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "clmq-demo-data").is_dir() and not (tmp_path / "clmq-data").exists()


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_export_from_a_directory_that_does_not_exist_is_one_line_and_makes_nothing(tmp_path, fmt: str) -> None:  # type: ignore[no-untyped-def]
    out = clmq(
        "export",
        "--data-dir",
        str(tmp_path / "absent"),
        "--format",
        fmt,
        "--out-dir",
        str(tmp_path / "out"),
        cwd=tmp_path,
    )
    one_line_error(out, 1, "no such directory")
    assert not (tmp_path / "out").exists()


def test_export_into_an_existing_output_is_refused_before_spark_starts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "data").mkdir()
    (tmp_path / "out").mkdir()
    one_line_error(
        clmq("export", "--data-dir", str(tmp_path / "data"), "--out-dir", str(tmp_path / "out"), cwd=tmp_path),
        EXIT_USAGE,
        "exists",
    )
    bad_time = clmq(
        "export",
        "--data-dir",
        str(tmp_path / "data"),
        "--from-time",
        "soon",
        "--out-dir",
        str(tmp_path / "o2"),
        cwd=tmp_path,
    )
    assert bad_time.returncode == 2 and "not understood" in bad_time.stderr


def test_a_metrics_port_already_taken_is_one_line_naming_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = clmq("nameserver", "--listen-port", "0", "--metrics-port", str(port), cwd=tmp_path)
    one_line_error(out, 1, f"cannot listen on 127.0.0.1:{port} for the name server metrics")
