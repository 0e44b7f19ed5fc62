"""clmq client (see the issues that build it)."""
