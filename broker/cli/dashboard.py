"""``clmq dashboard``: a web dashboard of a clmq cluster, read through the admin API.

Pages: brokers and their roles with live rates, topics with their queues and offsets,
consumer groups with the lag per queue and its trend, and message browsing (a queue
from an offset, a message by id, messages by key). Served by clmq's small HTTP server
on trio; the charts are uPlot, shipped in the package (no CDN).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import trio

from clmq.client import open_admin
from clmq.protocol.transport import serve_http, tls_settings

from ._common import addrs, listen_port_arg, namesrv_arg, run_client
from ._dashboard_app import Dashboard, DashboardSettings
from ._errors import EXIT_USAGE, CliError
from ._output import add_output_arg, console, is_json, write_json
from ._timefmt import DURATION_MS

__all__ = ["Dashboard", "DashboardSettings", "add_command"]


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
    add_output_arg(p)
    namesrv_arg(p)
    p.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    try:
        settings = DashboardSettings(poll_interval_ms=args.poll_interval_ms, history_points=args.history_points)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    try:  # HTTPS (docs/security-tls.md): the page's own certificate; its clients' TLS: --tls-ca ...
        https = tls_settings(cert_file=args.https_cert or "", key_file=args.https_key or "")
        context = https.server_context() if https is not None else None
    except ValueError as e:
        raise CliError(f"--https-cert/--https-key: {e}", EXIT_USAGE) from None

    async def main() -> None:
        async with open_admin(addrs(args)) as admin, trio.open_nursery() as nursery:
            board = Dashboard(admin, settings)
            serve = functools.partial(serve_http, tls=context)
            port = await nursery.start(serve, args.listen_host, args.listen_port, board.route, "dashboard")
            url = f"{'https' if context else 'http'}://{args.listen_host}:{port}/"
            console.print(f"dashboard on {url} (name servers {args.namesrv}; Ctrl-C stops)", highlight=False)
            if is_json(args):
                write_json({"url": url, "namesrv": args.namesrv})
            nursery.start_soon(board.sample_forever)

    return run_client(main)
