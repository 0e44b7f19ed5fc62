"""Leader/follower replication of the whole CommitLog (issue 15 builds it here).

The room's rules, set now so that the work lands without a reshuffle:

- it sits in the *services* layer: it may import ``broker.store``, ``protocol`` and
  ``protocol.transport``; ``broker.service`` wires it in, it does not import the
  service's handlers;
- a follower writes through the store's replication hooks
  (``CommitLog.append_raw``, ``Store.truncate``, ``CommitLog.set_confirmed_offset``),
  never around them;
- no kazoo here: who leads is decided in ``broker.coordination``.
"""
