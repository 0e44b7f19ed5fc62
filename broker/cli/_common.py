"""What the ``clmq`` verbs share: the name-server argument, addresses and ports,
deprecated spellings of flags, running a client command."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Callable, Iterator, Sequence

import trio

from ._errors import EXIT_USAGE, CliError
from ._output import add_output_arg

DEFAULT_NAMESRV = "127.0.0.1:9876"
NAMESRV_HELP = "name server address(es), host:port[,host:port...] (default $CLMQ_NAMESRV or 127.0.0.1:9876)"


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag (``--port`` for ``--listen-port``), hidden from the
    help: it still works, with a one-line note on stderr naming the new one."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(f"note: {option_string} is deprecated: use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def deprecated_alias(parser: argparse._ActionsContainer, old: str, new: str, dest: str, **kwargs: Any) -> None:
    """``old`` as a hidden alias of ``new`` (same ``dest``, ``type``, ...); pass
    ``nargs=0, const=...`` for a flag that takes no value."""
    parser.add_argument(old, dest=dest, action=DeprecatedAlias, new=new, **kwargs)


def namesrv_arg(p: argparse.ArgumentParser) -> None:
    """``--namesrv host:port[,host:port...]`` (checked when parsed), and the client's
    security flags (:func:`security_args`)."""
    p.add_argument(
        "--namesrv",
        default=os.environ.get("CLMQ_NAMESRV", DEFAULT_NAMESRV),
        type=addr_list,
        help=NAMESRV_HELP,
    )
    security_args(p)


# A client verb's security flags, and the environment variable each one stands for
# (the clients read these when given no security: client/_arguments.py).
SECURITY_FLAGS = {
    "tls_ca": "CLMQ_TLS_CA_FILE",
    "tls_cert": "CLMQ_TLS_CERT_FILE",
    "tls_key": "CLMQ_TLS_KEY_FILE",
    "user": "CLMQ_USER",
}


def security_args(p: argparse.ArgumentParser) -> None:
    """``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--user``, ``--password-env``: TLS
    and a login for a client verb (default: ``$CLMQ_TLS_CA_FILE``, ``$CLMQ_TLS_CERT_FILE``,
    ``$CLMQ_TLS_KEY_FILE``, ``$CLMQ_USER``, ``$CLMQ_PASSWORD``). The password is never a
    flag (it would show in ``ps`` and the shell's history)."""
    if any(a.dest == "tls_ca" for a in p._actions):
        return
    g = p.add_argument_group("security (docs/security.md#tls)")
    g.add_argument(
        "--tls-ca", metavar="FILE", help="TLS: the CA the servers' certificates chain to ($CLMQ_TLS_CA_FILE)"
    )
    g.add_argument(
        "--tls-cert", metavar="FILE", help="TLS: this client's certificate, for mutual TLS ($CLMQ_TLS_CERT_FILE)"
    )
    g.add_argument("--tls-key", metavar="FILE", help="TLS: the key of --tls-cert ($CLMQ_TLS_KEY_FILE)")
    g.add_argument(
        "--user", help="log in as this user ($CLMQ_USER); the password from --password-env or $CLMQ_PASSWORD"
    )
    g.add_argument(
        "--password-env",
        metavar="VAR",
        help="the environment variable holding --user's password (default CLMQ_PASSWORD)",
    )


@contextlib.contextmanager
def security_env(args: argparse.Namespace) -> Iterator[None]:
    """The security flags of ``args`` as the environment variables they stand for, while
    a command runs (every client it opens reads them; restored afterwards)."""
    values = {var: getattr(args, flag, None) for flag, var in SECURITY_FLAGS.items()}
    var = getattr(args, "password_env", None)
    if var:
        if var not in os.environ:
            raise CliError(f"--password-env {var}: the environment variable {var} is not set", EXIT_USAGE)
        values["CLMQ_PASSWORD"] = os.environ[var]
    with environment({k: str(v) for k, v in values.items() if v}):
        yield


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in the process's environment while the block runs, then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def add_json_alias(parser: argparse.ArgumentParser) -> None:
    """The old ``--json`` flag: a hidden, deprecated alias of ``-o json``."""
    deprecated_alias(parser, "--json", "-o json", "output", nargs=0, const="json")


def add_client_args(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """``-o/--output`` and ``--namesrv`` on each of a verb's sub-commands."""
    for p in parsers.values():
        add_output_arg(p)
        namesrv_arg(p)


def addr_list(text: str) -> str:
    """``host:port[,host:port...]``, each port 1..65535; CliError (usage) otherwise."""
    parts = [a.strip() for a in text.split(",") if a.strip()]
    if not parts:
        raise CliError(f"address list {text!r} is empty: give host:port", EXIT_USAGE)
    for part in parts:
        check_addr(part)
    return ",".join(parts)


def check_addr(addr: str) -> str:
    """``addr`` if it is ``host:port`` with a port in 1..65535; CliError (usage) naming it otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise CliError(f"address {addr!r}: give host:port, e.g. 127.0.0.1:9876", EXIT_USAGE)
    check_port(int(port), addr)
    return addr


def check_port(port: int, what: str) -> int:
    """``port`` if it is a TCP port a service can listen on or connect to (1..65535)."""
    if not 1 <= port <= 65535:
        raise CliError(f"{what}: port {port} is outside 1..65535", EXIT_USAGE)
    return port


def listen_port_arg(text: str) -> int:
    """``argparse`` ``type=`` for a port to listen on: 0 (any free port) to 65535."""
    if not text.strip().isdigit():
        raise CliError(f"port {text!r}: give a number in 0..65535", EXIT_USAGE)
    port = int(text)
    if port > 65535:
        raise CliError(f"port {port} is outside 0..65535 (0: any free port)", EXIT_USAGE)
    return port


def addrs(args: argparse.Namespace) -> list[str]:
    return [a.strip() for a in args.namesrv.split(",") if a.strip()]


def run_client(fn: Callable[[], Any]) -> int:
    """Run a client command under trio; its errors reach ``main``, which prints them as
    one line with their exit code."""
    return int(trio.run(fn) or 0)
