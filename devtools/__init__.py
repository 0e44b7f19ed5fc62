"""Tools for development and tests, not for production: a local ZooKeeper server
(:mod:`clmq.devtools.zkserver`) for ``clmq dev --zookeeper``, the failover benchmark
and the test fixtures, and throw-away TLS certificates (:mod:`clmq.devtools.certs`) for
``clmq dev --tls`` and the TLS tests. Nothing of the broker imports this room."""

from .certs import Ca, CertFiles, DevCerts, make_ca, make_cert, make_dev_certs

__all__ = ["Ca", "CertFiles", "DevCerts", "make_ca", "make_cert", "make_dev_certs"]
