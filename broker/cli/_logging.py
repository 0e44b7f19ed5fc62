"""Logging of every ``clmq`` command: the flags, and the set-up they ask for."""

from __future__ import annotations

import argparse
import logging


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """The logging flags every ``clmq`` command takes."""
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def configure_logging(args: argparse.Namespace) -> None:
    """Set up the root logger as ``args`` (parsed with :func:`add_logging_args`) say."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
