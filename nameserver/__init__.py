"""clmq nameserver (see the issues that build it)."""
