"""POP errors (``RequestError`` of ``clmq.broker.service.pop``) as the Kafka error codes
of share partitions, chosen by what the Java client (kafka-clients 4.4.0's
KafkaShareConsumer) does with each code.

ShareFetch, a partition's ``error_code`` (``ShareFetchCollector.handleInitializeErrors``):
NOT_LEADER_OR_FOLLOWER (6), REPLICA_NOT_AVAILABLE (9), KAFKA_STORAGE_ERROR (56),
FENCED_LEADER_EPOCH (74), OFFSET_NOT_AVAILABLE (78), UNKNOWN_TOPIC_OR_PARTITION (3),
UNKNOWN_TOPIC_ID (100) and INCONSISTENT_TOPIC_ID (103) are logged and followed by a
metadata refresh, UNKNOWN_LEADER_EPOCH (76) and UNKNOWN_SERVER_ERROR (-1) only logged:
the partition is fetched again. Any other code (LEADER_NOT_AVAILABLE 5, REQUEST_TIMED_OUT
7, NOT_ENOUGH_REPLICAS 19, ...) is thrown out of ``poll()`` as "Unexpected error code".

ShareAcknowledge, a partition's ``error_code`` (``ShareConsumeRequestManager.
handlePartitionError``): NOT_LEADER_OR_FOLLOWER and FENCED_LEADER_EPOCH are reported to
the application (the leader moved: its locks are gone), a code whose exception is a
``RetriableException`` (5, 7, 9, 19, ...) is sent again until the commit's timeout, any
other is reported. The ``acknowledge_error_code`` of acknowledgements carried by a
ShareFetch is reported as it is, never retried.

So a POP state that is starting or recovering (SYSTEM_BUSY: after a start or a
promotion, until the checkpoint is loaded and ``%POP%`` replayed) is REPLICA_NOT_AVAILABLE
for both: the fetch comes again after a metadata refresh, the acknowledgement is sent
again. A write of the POP state not confirmed in time or without its replicas is the
same for a fetch; for an acknowledgement it is REQUEST_TIMED_OUT / NOT_ENOUGH_REPLICAS
(retried; an acknowledgement applied although its answer was lost is then refused as
INVALID_RECORD_STATE, and its record stays settled).
"""

from __future__ import annotations

from clmq.protocol.kafka import ErrorCode

# A POP error of a fetch (of a whole topic) as the Kafka error of its partitions.
FETCH_ERRORS = {
    "NOT_LEADER": ErrorCode.NOT_LEADER_OR_FOLLOWER,
    "STALE_EPOCH": ErrorCode.NOT_LEADER_OR_FOLLOWER,
    "TOPIC_NOT_FOUND": ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    "INVALID_QUEUE_ID": ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    "SYSTEM_BUSY": ErrorCode.REPLICA_NOT_AVAILABLE,
    "TIMEOUT": ErrorCode.REPLICA_NOT_AVAILABLE,
    "FLUSH_DISK_TIMEOUT": ErrorCode.REPLICA_NOT_AVAILABLE,
    "REPLICATION_TIMEOUT": ErrorCode.REPLICA_NOT_AVAILABLE,
    "NOT_ENOUGH_REPLICAS": ErrorCode.REPLICA_NOT_AVAILABLE,
}

# A POP error of a partition's acknowledgements as its Kafka error.
ACK_ERRORS = {
    "NOT_LEADER": ErrorCode.NOT_LEADER_OR_FOLLOWER,
    "STALE_EPOCH": ErrorCode.NOT_LEADER_OR_FOLLOWER,
    "TOPIC_NOT_FOUND": ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    "INVALID_QUEUE_ID": ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    "SYSTEM_BUSY": ErrorCode.REPLICA_NOT_AVAILABLE,
    "TIMEOUT": ErrorCode.REQUEST_TIMED_OUT,
    "FLUSH_DISK_TIMEOUT": ErrorCode.REQUEST_TIMED_OUT,
    "REPLICATION_TIMEOUT": ErrorCode.REQUEST_TIMED_OUT,
    "NOT_ENOUGH_REPLICAS": ErrorCode.NOT_ENOUGH_REPLICAS,
}


def fetch_error(pop_code: str) -> int:
    """The Kafka error of a fetch's partitions for the POP error named ``pop_code``."""
    return FETCH_ERRORS.get(pop_code, ErrorCode.UNKNOWN_SERVER_ERROR)


def ack_error(pop_code: str) -> int:
    """The Kafka error of a partition's acknowledgements for the POP error named ``pop_code``."""
    return ACK_ERRORS.get(pop_code, ErrorCode.UNKNOWN_SERVER_ERROR)
