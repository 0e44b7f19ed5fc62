"""Leader/follower replication of the whole CommitLog: one stream per broker, the log's
raw bytes in order (docs/replication.md).

- :class:`Replica` is one broker's place in its group (leader or follower, promotion,
  stepping down); the broker's service wires it in and asks it before writes. Its
  parts share one ``ReplicaState``: ``Roles`` (the switches and the role's tasks),
  ``WriteChecks`` (before and after writes), ``ReplicaRequests`` (its requests).
- :class:`Leader` serves followers (REPLICA_JOIN, REPLICA_FETCH, REPLICA_METADATA)
  and keeps the in-sync set and the confirmed offset (:class:`InSyncSet`).
- :class:`Follower` copies the leader's log through the store's replication hooks
  (``CommitLog.append_raw``, ``Store.truncate``, ``Store.restart_at``,
  ``CommitLog.set_confirmed_offset``), never around them.
- :class:`LeaderEpochs` and :func:`divergence`: which term wrote which bytes, and where
  a rejoining replica's log stops agreeing with its leader's.

It sits in the *services* layer: it imports ``clmq.broker.store``, ``protocol`` and
``clmq.protocol.transport``, never the service (which implements :class:`MetadataPort` for
it). No kazoo here: automatic election belongs to ``clmq.broker.coordination``.
"""

from ._config import ACK_MODES, REPLICA_ACKS, ROLES, ReplicationConfig
from ._epochs import LeaderEpochs, divergence
from ._follower import Follower
from ._insync import FollowerState, InSyncSet
from ._leader import Leader
from ._ports import MetadataPort
from ._replica import Replica

__all__ = [
    "ACK_MODES",
    "REPLICA_ACKS",
    "ROLES",
    "Follower",
    "FollowerState",
    "InSyncSet",
    "Leader",
    "LeaderEpochs",
    "MetadataPort",
    "Replica",
    "ReplicationConfig",
    "divergence",
]
