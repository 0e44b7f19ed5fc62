"""``python -m clmq``: the same as the ``clmq`` command."""

import sys

from clmq.broker.cli.main import main

sys.exit(main())
