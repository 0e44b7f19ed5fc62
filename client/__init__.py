"""clmq's clients: producer, consumer and admin, for trio code (``open_producer``,
``open_consumer``, ``open_admin``), asyncio (``open_asyncio_*``) and plain synchronous
Python (``Blocking*``). The admin also manages users and ACLs (:class:`AclBinding`,
:class:`AclFilter`). Each takes name server addresses (a string ``"h1:9876,h2:9876"``
or a list; ``broker_addrs`` for a direct connection; neither: ``$CLMQ_NAMESRV``) and its
options as typed keyword arguments (:class:`ProducerOptions`, :class:`ConsumerOptions`),
and ``security`` (:class:`ClientSecurity`: TLS, a login; or ``$CLMQ_TLS_*``,
``$CLMQ_USER``, ``$CLMQ_PASSWORD``)."""

from clmq.common import ClientError, ClmqError, Message, Record
from clmq.protocol.auth import AclBinding, AclFilter, Operation, PatternType, Permission, ResourceType
from clmq.protocol.transport import (
    AuthenticationFailed,
    ClientSecurity,
    ConnectionFailed,
    RpcClient,
    RpcError,
    TlsSettings,
    split_addr,
)

from ._admin import Admin, open_admin
from ._admin_index import IndexLookup
from ._admin_reads import CancelResult, DeadLetter, KeyLookup, ResendResult, ResentLetter
from ._admin_trace import MessageTrace
from ._asyncio import (
    AsyncioAdmin,
    AsyncioConsumer,
    AsyncioPopConsumer,
    AsyncioProducer,
    ClientClosedError,
    open_asyncio_admin,
    open_asyncio_consumer,
    open_asyncio_pop_consumer,
    open_asyncio_producer,
)
from ._blocking import BlockingAdmin, BlockingConsumer, BlockingPopConsumer, BlockingProducer
from ._msg_id import format_msg_id, parse_msg_id
from ._routes import MessageQueue, NoRouteError, ReadRouter, Routes
from .consumer import (
    Consumer,
    ConsumerOptions,
    ConsumeStatus,
    DamagedQueueError,
    SendBackError,
    SendBackResult,
    TagFilter,
    allocate_averagely,
    open_consumer,
)
from .pop import PopConsumer, PopConsumerOptions, PopStats, open_pop_consumer
from .producer import (
    BatchTooLargeError,
    BufferFullError,
    LocalTransactionState,
    Producer,
    ProducerOptions,
    SendError,
    SendFuture,
    SendResult,
    TransactionListener,
    TransactionResult,
    open_producer,
    shard,
)

__all__ = [
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
    "BufferFullError",
    "CancelResult",
    "ClientClosedError",
    "ClientError",
    "ClientSecurity",
    "ClmqError",
    "ConnectionFailed",
    "ConsumeStatus",
    "Consumer",
    "ConsumerOptions",
    "DamagedQueueError",
    "DeadLetter",
    "IndexLookup",
    "KeyLookup",
    "LocalTransactionState",
    "Message",
    "MessageQueue",
    "MessageTrace",
    "NoRouteError",
    "Operation",
    "PatternType",
    "Permission",
    "PopConsumer",
    "PopConsumerOptions",
    "PopStats",
    "Producer",
    "ProducerOptions",
    "ReadRouter",
    "Record",
    "ResendResult",
    "ResentLetter",
    "ResourceType",
    "Routes",
    "RpcClient",
    "RpcError",
    "SendBackError",
    "SendBackResult",
    "SendError",
    "SendFuture",
    "SendResult",
    "TagFilter",
    "TlsSettings",
    "TransactionListener",
    "TransactionResult",
    "allocate_averagely",
    "format_msg_id",
    "open_admin",
    "open_asyncio_admin",
    "open_asyncio_consumer",
    "open_asyncio_pop_consumer",
    "open_asyncio_producer",
    "open_consumer",
    "open_pop_consumer",
    "open_producer",
    "parse_msg_id",
    "shard",
    "split_addr",
]
