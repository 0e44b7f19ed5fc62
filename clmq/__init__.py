"""clmq: a message broker that stores every queue in one sequential CommitLog.

The one import package of clmq. Its sub-packages are the project's rooms
(``clmq.commitlog``, ``clmq.client``, ``clmq.broker.service``, ...; docs/architecture.md
draws them); this module is the public face::

    from clmq import open_producer, open_consumer, open_admin, Message

    async with open_producer("127.0.0.1:9876", linger_ms=5) as producer:
        await producer.send("orders", b"hello")

Clients take addresses as a string or a list (none: ``$CLMQ_NAMESRV``) and their options
as typed keyword arguments (:class:`ProducerOptions`, :class:`ConsumerOptions`).

Names are loaded on first use (PEP 562), so ``import clmq.commitlog`` or
``from clmq import Store`` never imports trio, and ``import clmq`` alone imports nothing
heavy. Type checkers and IDEs see every name through the ``TYPE_CHECKING`` block below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# public name -> the module that defines it (one table: __all__, __getattr__ and the
# test that imports every public name from a built wheel all read it)
_EXPORTS: dict[str, str] = {
    # clients (trio)
    "open_producer": "clmq.client", "open_consumer": "clmq.client", "open_admin": "clmq.client",
    "Producer": "clmq.client", "Consumer": "clmq.client", "Admin": "clmq.client",
    "ConsumerOptions": "clmq.client", "ProducerOptions": "clmq.client",
    # clients (asyncio, plain synchronous Python)
    "open_asyncio_producer": "clmq.client", "open_asyncio_consumer": "clmq.client",
    "open_asyncio_admin": "clmq.client",
    "AsyncioProducer": "clmq.client", "AsyncioConsumer": "clmq.client", "AsyncioAdmin": "clmq.client",
    "BlockingProducer": "clmq.client", "BlockingConsumer": "clmq.client", "BlockingAdmin": "clmq.client",
    # POP consumption (docs/consuming.md): trio, asyncio, blocking
    "open_pop_consumer": "clmq.client", "PopConsumer": "clmq.client", "PopConsumerOptions": "clmq.client",
    "open_asyncio_pop_consumer": "clmq.client", "AsyncioPopConsumer": "clmq.client",
    "BlockingPopConsumer": "clmq.client",
    # what clients send, receive and get back
    "Message": "clmq.common", "Record": "clmq.common",
    "SendResult": "clmq.client", "SendFuture": "clmq.client", "ConsumeStatus": "clmq.client",
    "TagFilter": "clmq.client", "MessageQueue": "clmq.client",
    "LocalTransactionState": "clmq.client", "TransactionListener": "clmq.client",  # transactions
    "TransactionResult": "clmq.client",
    "AclBinding": "clmq.client", "AclFilter": "clmq.client",  # the admin's ACLs
    "ClientSecurity": "clmq.client", "TlsSettings": "clmq.client",  # TLS and a login
    # errors
    "ClmqError": "clmq.common", "ClientError": "clmq.common", "SendError": "clmq.client",
    "NoRouteError": "clmq.client", "ConnectionFailed": "clmq.client", "RpcError": "clmq.client",
    "AuthenticationFailed": "clmq.client",
    "BufferFullError": "clmq.client", "BatchTooLargeError": "clmq.client",
    "StoreError": "clmq.common", "CorruptRecordError": "clmq.common", "ConfigError": "clmq.common",
    # the embedded store and the services
    "Store": "clmq.broker.store", "StoreConfig": "clmq.broker.store", "FlushMode": "clmq.commitlog",
    "CommitLog": "clmq.commitlog", "CommitLogConfig": "clmq.commitlog",
    "BrokerConfig": "clmq.broker.service", "serve_broker": "clmq.broker.service",
    "NameServerConfig": "clmq.nameserver", "serve_nameserver": "clmq.nameserver",
}  # fmt: skip
# names whose defining module calls them something else
_RENAMED = {"serve_broker": "serve", "serve_nameserver": "serve"}

__all__ = [  # the names of _EXPORTS (a test checks that they agree)
    "AclBinding",
    "AclFilter",
    "Admin",
    "AsyncioAdmin",
    "AsyncioConsumer",
    "AsyncioPopConsumer",
    "AsyncioProducer",
    "AuthenticationFailed",
    "BatchTooLargeError",
    "BlockingAdmin",
    "BlockingConsumer",
    "BlockingPopConsumer",
    "BlockingProducer",
    "BrokerConfig",
    "BufferFullError",
    "ClientError",
    "ClientSecurity",
    "ClmqError",
    "CommitLog",
    "CommitLogConfig",
    "ConfigError",
    "ConnectionFailed",
    "ConsumeStatus",
    "Consumer",
    "ConsumerOptions",
    "CorruptRecordError",
    "FlushMode",
    "LocalTransactionState",
    "Message",
    "MessageQueue",
    "NameServerConfig",
    "NoRouteError",
    "PopConsumer",
    "PopConsumerOptions",
    "Producer",
    "ProducerOptions",
    "Record",
    "RpcError",
    "SendError",
    "SendFuture",
    "SendResult",
    "Store",
    "StoreConfig",
    "StoreError",
    "TagFilter",
    "TlsSettings",
    "TransactionListener",
    "TransactionResult",
    "__version__",
    "open_admin",
    "open_asyncio_admin",
    "open_asyncio_consumer",
    "open_asyncio_pop_consumer",
    "open_asyncio_producer",
    "open_consumer",
    "open_pop_consumer",
    "open_producer",
    "serve_broker",
    "serve_nameserver",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'clmq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _RENAMED.get(name, name))
    globals()[name] = value  # the next look-up does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from clmq.broker.service import BrokerConfig
    from clmq.broker.service import serve as serve_broker
    from clmq.broker.store import Store, StoreConfig
    from clmq.client import (
        AclBinding,
        AclFilter,
        Admin,
        AsyncioAdmin,
        AsyncioConsumer,
        AsyncioPopConsumer,
        AsyncioProducer,
        AuthenticationFailed,
        BatchTooLargeError,
        BlockingAdmin,
        BlockingConsumer,
        BlockingPopConsumer,
        BlockingProducer,
        BufferFullError,
        ClientSecurity,
        ConnectionFailed,
        Consumer,
        ConsumerOptions,
        ConsumeStatus,
        LocalTransactionState,
        MessageQueue,
        NoRouteError,
        PopConsumer,
        PopConsumerOptions,
        Producer,
        ProducerOptions,
        RpcError,
        SendError,
        SendFuture,
        SendResult,
        TagFilter,
        TlsSettings,
        TransactionListener,
        TransactionResult,
        open_admin,
        open_asyncio_admin,
        open_asyncio_consumer,
        open_asyncio_pop_consumer,
        open_asyncio_producer,
        open_consumer,
        open_pop_consumer,
        open_producer,
    )  # fmt: skip
    from clmq.commitlog import CommitLog, CommitLogConfig, FlushMode
    from clmq.common import ClientError, ClmqError, ConfigError, CorruptRecordError, Message, Record, StoreError
    from clmq.nameserver import NameServerConfig
    from clmq.nameserver import serve as serve_nameserver
