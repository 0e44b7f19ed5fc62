"""``python -m broker.cli``: the same as the ``clmq`` command."""

import sys

from .main import main

sys.exit(main())
