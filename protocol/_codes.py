"""Every request code and error code of the wire protocol, in one place.

Requests and their fields (``fields`` is the frame header's named-field map; "body"
is the raw frame body). Responses carry the same request id, the RESPONSE flag, an
error code (0 = OK) and text, and the fields listed after the arrow.

Broker
======
=====================  ============================================================
SEND_MESSAGE           topic; body: a message batch (``encode_batch``)
                       -> queue_ids, queue_offsets, msg_ids, durable (bool)
PULL_MESSAGE           topic, queue_id, offset, max_messages, max_wait_ms,
                       tags (list or absent), group (for lag accounting)
                       -> status, next_offset, min_offset, max_offset, count;
                       body: the records, exactly as stored in the CommitLog
PULL_MESSAGES          queues: [[topic, queue_id, offset, tags or nil], ...],
                       max_messages (in all), max_per_queue, max_wait_ms
                       -> results: [[status, next_offset, count, bytes, max_offset], ...]
                       (one per queue, in order; SKIPPED: not read this time, max_offset
                       -1), count; body: the records of each queue in turn, ``bytes`` of
                       them per queue. max_offset (Kafka's high watermark) tells a
                       client that it has caught up without asking again
QUERY_OFFSETS          topic, queue_id -> min_offset, max_offset
SEARCH_OFFSET          topic, queue_id, timestamp_ms -> offset
COMMIT_OFFSET          group, offsets: [[topic, queue_id, offset], ...] -> (nothing)
QUERY_CONSUMER_OFFSET  group, topic, queue_id -> offset (-1: none committed)
QUERY_QUEUE_OFFSETS    group, queues: [[topic, queue_id], ...]
                       -> offsets: [[committed or -1, min, max] or nil (no such queue), ...]
HEARTBEAT              client_id, groups: [{group, topics, mode}] -> (nothing)
UNREGISTER_CLIENT      client_id -> (nothing)
GET_GROUP_MEMBERS      group -> members (sorted client ids)
LIST_GROUPS            -> groups
DESCRIBE_GROUP         group -> queues: [{topic, queue_id, committed, max_offset, lag}],
                       members
CREATE_TOPIC           topic, queue_count -> (nothing); also changes a queue count
DELETE_TOPIC           topic -> (nothing)
LIST_TOPICS            -> topics: {name: queue_count}
DESCRIBE_TOPIC         topic -> queue_count, queues: [{queue_id, min_offset, max_offset}]
BROKER_INFO            -> name, addr, storage_mode, flush_mode, end_offset, ...
GET_LOG_LAYOUT         -> min_offset, end_offset (durable, dispatched and confirmed),
                       segments: [[base, data_end, [record starts...]], ...],
                       topics: {name: queue_count}, message_count, storage_mode
                       (commitlog mode only: REQUEST_NOT_SUPPORTED otherwise)
READ_LOG               offset, max_bytes, end_offset -> offset, length; body: the
                       log's raw bytes [offset, offset + length) within one segment,
                       never past end_offset or what is durable (the reader walks and
                       CRC-checks the records; a record may be cut at the end)
=====================  ============================================================

Name server
===========
=====================  ============================================================
REGISTER_BROKER        cluster, broker_name, addr, topics: {name: queue_count}
UNREGISTER_BROKER      broker_name, addr
GET_ROUTE              topic -> brokers: [{broker_name, addr, queue_count}]
GET_CLUSTER            -> brokers: [{broker_name, addr, cluster, topics, age_ms}]
=====================  ============================================================
"""

from __future__ import annotations

import enum


class RequestCode(enum.IntEnum):
    SEND_MESSAGE = 10
    PULL_MESSAGE = 11
    PULL_MESSAGES = 12
    QUERY_OFFSETS = 20
    SEARCH_OFFSET = 21
    COMMIT_OFFSET = 30
    QUERY_CONSUMER_OFFSET = 31
    QUERY_QUEUE_OFFSETS = 32
    HEARTBEAT = 40
    UNREGISTER_CLIENT = 41
    GET_GROUP_MEMBERS = 42
    LIST_GROUPS = 43
    DESCRIBE_GROUP = 44
    CREATE_TOPIC = 50
    DELETE_TOPIC = 51
    LIST_TOPICS = 52
    DESCRIBE_TOPIC = 53
    BROKER_INFO = 60
    GET_LOG_LAYOUT = 70
    READ_LOG = 71
    REGISTER_BROKER = 100
    UNREGISTER_BROKER = 101
    GET_ROUTE = 102
    GET_CLUSTER = 103


class ErrorCode(enum.IntEnum):
    OK = 0
    SYSTEM_ERROR = 1  # the server failed; the text says how
    SYSTEM_BUSY = 2  # too much in flight: retry later, or elsewhere
    REQUEST_NOT_SUPPORTED = 3  # unknown request code
    MALFORMED_REQUEST = 4  # missing or mistyped fields, undecodable body
    FRAME_TOO_LARGE = 5  # the frame exceeds the server's max_frame_bytes
    VERSION_MISMATCH = 6
    SHUTTING_DOWN = 7
    TIMEOUT = 8
    TOPIC_NOT_FOUND = 17
    INVALID_TOPIC = 18
    INVALID_QUEUE_ID = 19
    MESSAGE_TOO_LARGE = 20
    INVALID_MESSAGE = 21
    FLUSH_DISK_TIMEOUT = 22  # written, not known durable within sync_flush_timeout_ms
    DISK_FULL = 23
    IO_ERROR = 24
    NOT_FOUND = 25  # e.g. no route for a topic, unknown group
