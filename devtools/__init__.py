"""Tools for development and tests, not for production: a local ZooKeeper server
(:mod:`clmq.devtools.zkserver`) for ``clmq dev --zookeeper``, the failover benchmark
and the test fixtures. Nothing of the broker imports this room."""
