"""clmq's broker, in rooms by responsibility (docs/architecture.md draws them):

- :mod:`clmq.broker.store`: the synchronous storage facade (both storage modes, recovery,
  checkpoints, topics). No trio: usable from any thread or script.
- :mod:`clmq.broker.service`: the broker as a trio network service (request handlers,
  append lane, long polling, groups, offsets).
- :mod:`clmq.broker.replication`: leader/follower replication of the CommitLog.
- :mod:`clmq.broker.coordination`: ZooKeeper membership and failover (the only room that
  imports kazoo).
- :mod:`clmq.broker.cli`: the ``clmq`` command line, settings files, ``clmq dev`` and the
  benchmarks.

This package itself exports nothing, so importing the store does not import trio.
"""
