"""The ``clmq`` command line (:func:`clmq.broker.cli.main.main`), settings files and
environment variables (:mod:`clmq.broker.cli.settings`), ``clmq dev`` and the benchmarks
(:mod:`clmq.bench`). The top layer: it may import every other package; none
imports it."""
