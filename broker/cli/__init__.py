"""The ``clmq`` command line (:func:`broker.cli.main.main`), settings files and
environment variables (:mod:`broker.cli.settings`), ``clmq dev`` and the benchmarks
(:mod:`broker.cli.bench`). The top layer: it may import every other package; none
imports it."""
