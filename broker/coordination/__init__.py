"""Cluster coordination through ZooKeeper (kazoo): membership, leader election and
epochs for broker groups (issue 16 builds it here).

The only room of clmq allowed to import kazoo (``tests/test_layering.py`` checks it).
It sits in the *services* layer and drives ``clmq.broker.replication``; kazoo's threads
hand their events to trio through a trio token, never by blocking the event loop.
"""

from ._coordinator import CoordinationConfig, GroupCoordinator
from ._state import CoordinationError, GroupState, split_connect

__all__ = ["CoordinationConfig", "CoordinationError", "GroupCoordinator", "GroupState", "split_connect"]
