"""The benchmark commands: ``clmq bench store``, ``compare`` (in-process or
``--via broker``), ``e2e`` and ``spark``. Plotting needs the ``bench`` extra
(matplotlib), Spark the ``spark`` extra."""
