"""Users and ACLs edited offline, in their file: a stopped broker's
``<data-dir>/security.json`` (``--data-dir``) or a name server's ``security_file``
(``--file``). This is how the first super user is made, before any login exists.

A broker's file is changed only while its store is closed: the store's ``lock`` is
taken for the change (as ``clmq store check`` takes it), so a broker cannot start
meanwhile, and a broker that runs refuses the change. A name server re-reads its file
when it changes, so ``--file`` takes no lock. Either file is written in the durable
metadata format (checksummed, the previous generation kept)."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

from clmq.broker.store import StoreLockedError, store_lock
from clmq.common import MetadataError
from clmq.protocol.auth import SECURITY_FILE, SecurityState, load_security, save_security

from ._errors import EXIT_FAILED, EXIT_USAGE, CliError


class OfflineSecurity:
    """One security file; ``lock_dir``: the store directory whose lock guards it."""

    def __init__(self, path: Path, lock_dir: Path | None) -> None:
        self.path = path
        self.lock_dir = lock_dir

    @classmethod
    def of_data_dir(cls, directory: Path) -> OfflineSecurity:
        if not directory.is_dir():
            raise CliError(
                f"data directory {directory} does not exist (a broker's data_dir; mkdir it before the first start)",
                EXIT_USAGE,
            )
        return cls(directory / SECURITY_FILE, directory)

    @classmethod
    def of_file(cls, path: Path) -> OfflineSecurity:
        if path.is_dir():
            raise CliError(f"--file {path} is a directory: give the name server's security_file", EXIT_USAGE)
        if not path.parent.is_dir():
            raise CliError(f"--file {path}: directory {path.parent} does not exist", EXIT_USAGE)
        return cls(path, None)

    def read(self) -> SecurityState:
        """The file's users and ACLs (an empty state if it was never written; its
        previous generation if the file is damaged: ``clmq store check`` shows that)."""
        quiet = logging.getLogger("clmq.store")  # the error below says it all, in one line
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            return load_security(self.path)
        except MetadataError as e:
            raise CliError(f"{e} (clmq store check shows it)", EXIT_FAILED) from None
        finally:
            quiet.setLevel(level)

    def change(self, make: Callable[[SecurityState], SecurityState]) -> SecurityState:
        """Apply ``make`` and write the file (unless nothing changed); the new state."""
        try:
            with store_lock(self.lock_dir) if self.lock_dir is not None else nullcontext():
                state = self.read()
                new = make(state)
                if new is not state:
                    save_security(self.path, new)
                return new
        except StoreLockedError:
            raise CliError(
                f"data directory {self.lock_dir} is in use (its lock is held): stop the broker first, "
                "or change users and ACLs online (--namesrv)",
                EXIT_FAILED,
            ) from None
