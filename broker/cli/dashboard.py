"""``clmq dashboard``: a web dashboard of a clmq cluster, read through the admin API.

Pages: brokers and their roles with live rates, topics with their queues and offsets,
consumer groups with the lag per queue and its trend, and message browsing (a queue
from an offset, a message by id, messages by key). Served by clmq's small HTTP server
on trio; the charts are uPlot, shipped in the package (no CDN).

Bound to 127.0.0.1 by default. Elsewhere (``--listen-host``) it asks every viewer for a
login (HTTP Basic) that the cluster checks (:mod:`._dashboard_login`); a cluster that
checks no logins leaves nothing to check them with, and the dashboard then refuses to
start unless ``--allow-anonymous`` says an open dashboard is meant.
"""

from __future__ import annotations

import argparse
import functools
import logging
from typing import Any

import trio

from clmq.client import Admin, open_admin
from clmq.protocol.transport import Login, is_loopback, serve_http, tls_settings

from ._common import addrs, listen_port_arg, namesrv_arg, run_client
from ._dashboard_app import NET_ERRORS, Dashboard, DashboardSettings
from ._dashboard_login import ClusterLogin
from ._errors import EXIT_UNREACHABLE, EXIT_USAGE, CliError
from ._output import add_output_arg, console, err_console, is_json, write_json
from ._timefmt import DURATION_MS

__all__ = ["Dashboard", "DashboardSettings", "add_command"]

log = logging.getLogger("clmq.dashboard")


def add_command(sub: Any) -> None:
    """Add ``clmq dashboard`` to the ``clmq`` parser."""
    p = sub.add_parser("dashboard", help="a web dashboard: brokers, topics, groups and their lag, messages")
    p.add_argument("--listen-host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--listen-port", type=listen_port_arg, default=8080, help="port (default 8080; 0: any free)")
    p.add_argument(
        "--poll-interval-ms",
        type=DURATION_MS,
        default=DashboardSettings.poll_interval_ms,
        help="how often rates and lags are sampled for the charts: ms, or 2s (default 2000)",
    )
    p.add_argument(
        "--history-points",
        type=int,
        default=DashboardSettings.history_points,
        help="samples kept for the charts (default 300)",
    )
    p.add_argument("--https-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM; with --https-key)")
    p.add_argument("--https-key", metavar="FILE", help="the key of --https-cert (PEM)")
    p.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="serve a non-loopback --listen-host without logins when the cluster checks none (warned)",
    )
    add_output_arg(p)
    namesrv_arg(p)
    p.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    try:
        settings = DashboardSettings(poll_interval_ms=args.poll_interval_ms, history_points=args.history_points)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    try:  # HTTPS (docs/security.md#tls): the page's own certificate; its clients' TLS: --tls-ca ...
        https = tls_settings(cert_file=args.https_cert or "", key_file=args.https_key or "")
        context = https.server_context() if https is not None else None
    except ValueError as e:
        raise CliError(f"--https-cert/--https-key: {e}", EXIT_USAGE) from None

    async def main() -> None:
        async with open_admin(addrs(args)) as admin, trio.open_nursery() as nursery:
            board = Dashboard(admin, settings)
            login = await _viewers_login(args, admin)
            serve = functools.partial(serve_http, tls=context, login=login)
            port = await nursery.start(serve, args.listen_host, args.listen_port, board.route, "dashboard")
            url = f"{'https' if context else 'http'}://{args.listen_host}:{port}/"
            console.print(
                f"dashboard on {url} (name servers {args.namesrv}{'; viewers log in' if login else ''}; Ctrl-C stops)",
                highlight=False,
            )
            if is_json(args):
                write_json({"url": url, "namesrv": args.namesrv})
            nursery.start_soon(board.sample_forever)

    return run_client(main)


async def _viewers_login(args: argparse.Namespace, admin: Admin) -> Login | None:
    """The viewers' login: none on loopback; elsewhere the cluster's (a login it
    checks), or none with --allow-anonymous when the cluster checks no logins."""
    if is_loopback(args.listen_host):
        return None
    gate = ClusterLogin(admin, admin.rpc.security.tls)  # the dashboard's own TLS toward the cluster
    try:
        checks = await gate.checks_logins()
    except NET_ERRORS as e:
        raise CliError(
            f"dashboard on {args.listen_host}: cannot ask the cluster whether it checks logins ({e}); "
            "viewers beyond this machine must log in with the cluster's users",
            EXIT_UNREACHABLE,
        ) from None
    if checks:
        return gate
    if not args.allow_anonymous:
        raise CliError(
            f"dashboard on {args.listen_host!r}, reachable from other machines, and the cluster checks no logins: "
            "anyone could read every message. Turn logins on in the cluster (auth_enabled, docs/security.md), "
            "listen on 127.0.0.1, or give --allow-anonymous to accept that",
            EXIT_USAGE,
        )
    text = (
        f"dashboard on {args.listen_host} without logins (--allow-anonymous): anyone who reaches it sees every message"
    )
    log.warning("%s", text)
    err_console.print(f"warning: {text}", highlight=False)
    return None
