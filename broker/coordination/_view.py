"""A broker's view of its group in ZooKeeper: the group's state node (with the version
read, for compare-and-set), the live members, and this broker's own member node. The
coordinator decides from the view; the view only reads and writes (layout: ``_state``)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from ._session import ZkSession
from ._state import GroupState, decode_member, encode_member

log = logging.getLogger("clmq.coordination")


class SayOnce:
    """Log a situation once, when it changes (the coordinator's rounds repeat it)."""

    def __init__(self, name: str, me: int) -> None:
        self.name, self.me = name, me
        self._said = ""

    def __call__(self, text: str, level: int) -> None:
        if text != self._said:
            self._said = text
            log.log(level, "%s: broker %d: %s", self.name, self.me, text)


class GroupView:
    """``state`` and ``version``: the group's state node as last read (or written);
    ``members``: live broker id -> address."""

    def __init__(self, session: ZkSession, base: str, me: int, addr: Callable[[], str], say: SayOnce) -> None:
        self.session = session
        self.state_path, self.members_path = f"{base}/state", f"{base}/members"
        self.me = me
        self.addr = addr  # where this broker listens (its member node says)
        self.say = say
        self.state: GroupState | None = None
        self.version = -1
        self.members: dict[int, str] = {}
        self._member_session: int | None = None  # the session that owns this broker's member node

    async def ensure_member(self, session: int | None) -> bool:
        """This broker's ephemeral member node, owned by the current session."""
        if session is None:
            return False
        if self._member_session == session:
            return True
        path = f"{self.members_path}/{self.me}"
        s = self.session
        try:
            await s.call(s.client.create_async, path, encode_member(self.addr()), ephemeral=True, makepath=True)
        except NodeExistsError:
            stat = await s.call(s.client.exists_async, path, watch=s.watch)
            if stat is not None and stat.ephemeralOwner != session:
                self.say(f"waiting for {path} of this broker's previous session to expire", logging.INFO)
                return False
        self._member_session = session
        return True

    async def read_state(self, first_epoch: int) -> None:
        """Read the state node (watched); create it, naming this broker the leader with
        ``first_epoch``, if the group has none yet."""
        s = self.session
        try:
            data, stat = await s.call(s.client.get_async, self.state_path, watch=s.watch)
        except NoNodeError:
            first = GroupState(self.me, first_epoch, (self.me,))
            try:
                await s.call(s.client.create_async, self.state_path, first.encode(), makepath=True)
                log.info("%s: broker %d created the group's state in ZooKeeper: %s", self.say.name, self.me, first)
            except NodeExistsError:
                pass
            data, stat = await s.call(s.client.get_async, self.state_path, watch=s.watch)
        self.state, self.version = GroupState.decode(data, self.state_path), stat.version

    async def read_members(self) -> None:
        s = self.session
        try:
            children = await s.call(s.client.get_children_async, self.members_path, watch=s.watch)
        except NoNodeError:
            children = []
        members: dict[int, str] = {}
        for child in children:
            try:
                data, _ = await s.call(s.client.get_async, f"{self.members_path}/{child}")
                members[int(child)] = decode_member(data)
            except (NoNodeError, ValueError):
                continue  # gone since listed, or not a broker id
        self.members = members

    async def cas(self, new: GroupState) -> bool:
        """Write the state if it is still the version read; True if written."""
        t0, session = time.monotonic(), self.session.session_id()
        try:
            stat = await self.session.call(self.session.client.set_async, self.state_path, new.encode(), self.version)
        except BadVersionError:
            self.session.poke()  # read again
            return False
        self.state, self.version = new, stat.version
        self.session.note_contact(t0, session)
        return True
