"""Every request code and error code of the wire protocol, in one place.

Requests and their fields (``fields`` is the frame header's named-field map; "body"
is the raw frame body). Every field of every request is checked for its type and
range before the request does anything (:func:`request_error`, the table
``REQUEST_FIELDS``): a field missing or of the wrong type or range is answered with
MALFORMED_REQUEST naming the field. Integers are never booleans; queue ids are in
0..2^31-1, offsets, timestamps and byte counts in 0..2^63-1; limits a broker clamps
(``max_messages``, ``max_wait_ms``...) must still be in range. Unknown fields are
ignored (a newer client may send more). Responses carry the same request id, the RESPONSE flag, an
error code (0 = OK) and text, and the fields listed after the arrow.

Broker
======
=====================  ============================================================
SEND_MESSAGE           topic, dedup (bool, optional); body: a message batch (``encode_batch``)
                       -> queue_ids, queue_offsets, msg_ids, durable (bool),
                       duplicate (true, or absent). dedup: a retry of a batch whose
                       earlier try had an unknown outcome: if the queue's tail holds
                       the batch (by the messages' UNIQ_KEY property, within
                       dedup_window_ms / dedup_max_messages) the answer carries the
                       offsets found and duplicate: true, and nothing is appended;
                       if only each queue's first messages of it are there (a batch
                       copied in part to a promoted follower), the rest is appended
                       and the answer carries stored_before (messages found).
                       NOT_LEADER answers carry leader_addr when it is known.
                       Scheduled messages: a batch to topic ``%TIMER%`` whose every
                       message carries DELIVER_AT_MS (epoch ms), REAL_TOPIC, REAL_QID
                       and REAL_TAGS properties and, as tags, its DELIVER_AT_MS
                       digits; the broker checks them (INVALID_MESSAGE naming the
                       message; TOPIC_NOT_FOUND for a real topic it lacks; a time past
                       timer_max_delay_ms) and its timer delivers each once, at its
                       time, into the real queue. msg_ids then name the scheduled
                       copies: CANCEL_MESSAGE takes them
PULL_MESSAGE           topic, queue_id, offset, max_messages, max_wait_ms,
                       tags (list or absent), group (for lag accounting)
                       -> status, next_offset, min_offset, max_offset, count,
                       suggest_follower (true, or absent: see below);
                       body: the records, exactly as stored in the CommitLog
                       (a damaged record at offset: CORRUPT_DATA naming file and offset)
PULL_MESSAGES          queues: [[topic, queue_id, offset, tags or nil], ...],
                       max_messages (in all), max_per_queue, max_wait_ms,
                       max_bytes (optional: the answer's body at most, clamped to
                       the broker's max_pull_bytes; queues past it are SKIPPED, but
                       the first record read is always answered, however large)
                       -> results: [[status, next_offset, count, bytes, max_offset], ...]
                       (one per queue, in order; SKIPPED: not read this time, max_offset
                       -1; CORRUPT: the record at next_offset is damaged, and a sixth
                       cell names the file, offset and check), count, suggest_follower
                       (true, or absent); body: the records of each queue in turn,
                       ``bytes`` of them per queue. max_offset (Kafka's high watermark)
                       tells a client that it has caught up without asking again.
                       suggest_follower (RocketMQ's "suggest pulling from slave"): set
                       by a leader with at least one follower in sync when the answer
                       leaves the reader more than the broker's
                       follower_read_lag_messages (0: never) behind a queue's
                       max_offset (for PULL_MESSAGES: any queue of the answer). A
                       client may read that group from a follower for a while
                       (clmq's consumer: follower_read_hold_ms). Followers serve
                       pulls up to their confirmed offset and never set it.
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
                       members; pop (absent when the group has no POP state on this
                       broker): {queues: [{topic, queue_id, next_offset (never popped
                       below it), settled_offset (the lowest not settled), max_offset,
                       lag (max - settled), inflight, redelivering (in flight, past
                       its deadline: visible again)}], members (client ids that popped
                       within pop_member_timeout_ms), popped, acked, ack_expired,
                       redelivered, dead_lettered (since this leader started),
                       invisible_time_ms_last}
DELETE_GROUP           group -> queues (how many committed offsets were dropped).
                       GROUP_ACTIVE while members are connected; NOT_FOUND for a
                       group with neither offsets nor members on this broker
CREATE_TOPIC           topic, queue_count -> queue_count; also grows a topic's queue
                       count (INVALID_TOPIC for fewer queues than it has: queues
                       cannot be removed, their messages would be stranded)
DELETE_TOPIC           topic -> (nothing)
LIST_TOPICS            include_system (bool, optional) -> topics: {name: queue_count}
                       (system topics, named ``%...``: ``%TIMER%``, ``%RETRY%group``,
                       ``%DLQ%group``, only with include_system)
CONSUMER_SEND_BACK     group, messages: [[commitlog_offset, delay_ms], ...],
                       max_reconsume_times (optional, default the broker's),
                       to_dlq (bool, optional: straight to the dead letters, for
                       orderly consumers that gave up in place)
                       -> results: [[destination ("retry" | "dlq"),
                       reconsume_times, deliver_at_ms (0 for dlq)], ...]. The group
                       failed on each record: the broker copies it (the attempt
                       count, the record header's reconsume_times, plus one) to
                       ``%RETRY%group`` through the timer, due after delay_ms (-1:
                       the group's back-off for that attempt), or to ``%DLQ%group``
                       once the count passes max_reconsume_times. The original topic,
                       queue and offset travel as properties (ORIGIN_*).
                       NOT_FOUND: no record at an offset (its whole request fails,
                       nothing is copied)
LOCK_QUEUES            group, client_id, queues: [[topic, queue_id], ...]
                       -> locked: [[topic, queue_id], ...] (those this client now
                       holds, each for lock_lease_ms from now), lease_ms. Orderly
                       consumers: a queue is processed only by the member holding
                       its lock; a held lock is renewed by asking again. A broker
                       that has just become the leader (or restarted over a store
                       holding topics) answers locked: [] for lock_lease_ms: it does
                       not know the locks granted before. NOT_LEADER on a follower
UNLOCK_QUEUES          group, client_id, queues -> (nothing): releases those held
                       (NOT_LEADER on a follower)
CANCEL_MESSAGE         commitlog_offset (a scheduled message's id names it)
                       -> state ("cancelled" | "already_cancelled" | "too_late":
                       delivered or due within timer_cancel_margin_ms), deliver_at_ms.
                       NOT_FOUND: no scheduled message there
END_TRANSACTION        group, commitlog_offset (the half message's: its msg id names
                       it), action ("commit" | "rollback"), from_check (bool,
                       optional: the answer to a CHECK_TRANSACTIONS) -> state
                       ("committed" | "rolled_back" | "already_committed" |
                       "already_rolled_back"), and once committed: msg_id,
                       queue_id, queue_offset of the message in its real queue.
                       Transactional (half) messages: a batch to topic
                       ``%TRANS_HALF%`` whose every message carries REAL_TOPIC,
                       REAL_QID, REAL_TAGS and TRAN_GROUP properties; stored, never
                       visible until committed (docs/transactions.md). NOT_FOUND:
                       no pending or ended half message of that group there;
                       NOT_LEADER on a follower
CHECK_TRANSACTIONS     group, client_id, max_messages (optional), max_wait_ms
                       (optional) -> checks: [[commitlog_offset, check_count], ...]
                       (long-polled: the half messages of the group older than
                       transaction_timeout_ms that the broker asks this live
                       producer about); body: those half records, in order. The
                       producer answers each with END_TRANSACTION (from_check);
                       one it leaves unanswered (UNKNOWN) is asked again later
LIST_TRANSACTIONS      group (optional: every group), max_messages (optional)
                       -> pending: [{commitlog_offset, group, topic, queue_id,
                       keys, uniq_key, stored_ms, checks, last_check_ms}], total
                       (the pending count, all of them), committed, rolled_back,
                       checks (since start)
QUERY_INDEX            topic, key, since_ms (optional), until_ms (optional),
                       max_results (optional) -> matches: [[commitlog_offset,
                       store_ms], ...] newest first, truncated (bool: more matched
                       than max_results), index_lag_bytes (log bytes not indexed
                       when asked: 0 unless index writes fail, or failed and left
                       more than index_query_catch_up_bytes; the index is first
                       brought up to the log); body: those records, in order. The key
                       index (docs/operations.md): a message's keys and its
                       UNIQ_KEY; every match still retained.
                       REQUEST_NOT_SUPPORTED in partition-per-file mode
POP_MESSAGE            group, client_id, topic, invisible_time_ms (1..pop_invisible_time_max_ms),
                       max_messages (optional, clamped to pop_max_messages), max_wait_ms
                       (optional: long poll while nothing is visible), tags (list or
                       absent), queue_ids (list of queue ids, optional: only those),
                       orderly (bool, optional: a queue with a message of this group in
                       flight gives nothing more until it is settled, so a queue is
                       processed in order), start_from ("earliest" | "latest",
                       optional: where a group new to a queue starts; a committed
                       offset of the group wins), max_reconsume_times (optional,
                       default the broker's), max_bytes (optional)
                       -> handles: [receipt handle, ...], attempts: [1 for a first
                       delivery, ...], deadline_ms (epoch ms: when they become visible
                       again unless acknowledged), count; body: the records, exactly as
                       stored, in order. POP consumption (docs/consuming.md): any number
                       of members take messages from any queue of the topic; each is
                       invisible to the group until deadline_ms, then delivered again
                       (the same record, attempts plus one), and after
                       max_reconsume_times further attempts copied to ``%DLQ%group``.
                       The pop is recorded (a CK record in ``%POP%``) durably as the
                       topic's ack mode and the flush mode promise before the answer.
                       A receipt handle is an opaque string (it names this broker,
                       the queue, the offset and the pop). REQUEST_NOT_SUPPORTED in
                       partition-per-file mode; NOT_LEADER on a follower
ACK_MESSAGE            group, handles: [receipt handle, ...]
                       -> results: ["ok" | "expired" | "gone" | "invalid", ...] (one per
                       handle, in order): ok: settled, never delivered again (recorded
                       durably before the answer); expired: its invisible time had
                       passed (it is, or will be, delivered again): refused, counted;
                       gone: no such delivery in flight (acknowledged already, or
                       dead-lettered); invalid: not a handle of this broker. More
                       than pop_max_handles_per_request handles: MALFORMED_REQUEST
                       naming it (nothing settled)
CHANGE_INVISIBLE_TIME  group, handles, invisible_time_ms (0..pop_invisible_time_max_ms:
                       from now; 0: visible at once, a nack)
                       -> results: [[status, new handle or ""], ...]: status as
                       ACK_MESSAGE's; an ok delivery stays with its member until the new
                       deadline under the new handle (the old one is then expired)
DESCRIBE_TOPIC         topic -> queue_count, queues: [{queue_id, min_offset, max_offset,
                       size_bytes}] (size_bytes: the records a queue holds, summed from
                       its index; -1 past describe_size_max_entries messages, or in
                       partition-per-file mode)
GET_MESSAGE            commitlog_offset -> (nothing); body: the record stored at that
                       offset of the CommitLog (a message id names the broker and this
                       offset), CRC-checked. NOT_FOUND if no record starts there (or
                       retention removed it); REQUEST_NOT_SUPPORTED in
                       partition-per-file mode
BROKER_INFO            -> name, addr, storage_mode, flush_mode, end_offset, ...,
                       healthy (bool), failure (why not, "" if healthy); timer_pending
                       (scheduled messages not yet delivered, -1 where the timer
                       does not run: a follower, partition-per-file), timer_delivered,
                       timer_cancelled, timer_undeliverable (since start),
                       timer_memory_bytes, timer_failure (the error that stopped
                       the timer, retried every second; "" while it works);
                       index_files, index_entries, index_end_offset,
                       index_failures (index writes that failed: the index fell
                       behind and catches up from the log; -1 each without an
                       index), index_error (the newest such error, "" none);
                       transactions_pending (-1 where no leader's transaction
                       service runs), transactions_committed,
                       transactions_rolled_back, transactions_checks (since it
                       became the leader), transactions_failure; pop_groups (-1
                       where no leader's POP service runs), pop_inflight,
                       pop_popped, pop_acked, pop_ack_expired, pop_redelivered,
                       pop_dead_lettered (over every group, since it became the
                       leader), pop_failure, pop_record_appends and
                       pop_record_requests (appends of %POP% records and the
                       requests they carried: the group commit, since start)
GET_LOG_LAYOUT         -> min_offset, end_offset (durable, dispatched and confirmed),
                       segments: [[base, data_end, [record starts...]], ...],
                       topics: {name: queue_count}, message_count, storage_mode
                       (commitlog mode only: REQUEST_NOT_SUPPORTED otherwise)
READ_LOG               offset, max_bytes, end_offset -> offset, length; body: the
                       log's raw bytes [offset, offset + length) within one segment,
                       never past end_offset or what is durable (the reader walks and
                       CRC-checks the records; a record may be cut at the end)
=====================  ============================================================

Replication (a follower to its leader; an operator to a replica)
================================================================
=====================  ============================================================
REPLICA_JOIN           broker_name, broker_id, epoch (the follower's latest, -1:
                       none), end_offset, segment_bytes, addr (optional: where the
                       follower listens, shown in REPLICA_STATUS) -> session, epoch, epochs:
                       [[epoch, start_offset], ...], end_offset, min_offset,
                       confirmed_offset, ack_durability ("written" | "flushed").
                       Refused (REPLICA_REFUSED) for another group's broker, the
                       leader's own id, an id not in the leader's replica_ids, or a
                       different segment size; NOT_LEADER from a follower
REPLICA_FETCH          broker_id, session, epoch, offset (the follower's log end:
                       this acknowledges every byte below it), flushed (its durable
                       offset), max_bytes, max_wait_ms, topics_version (which
                       of this leader's topics versions it has copied in this
                       session; -1: none yet; a topic change is answered once every
                       in-sync follower holds it) -> epoch, offset, length,
                       end_offset, min_offset, confirmed_offset, in_sync,
                       metadata_version, topics_version; body: the leader's raw log bytes [offset,
                       offset + length) within one segment (a record may be cut at
                       the end). STALE_EPOCH: join again; OFFSET_OUT_OF_RANGE: the
                       offset is below the leader's log start (fields: min_offset);
                       REPLICA_REFUSED: an offset past the leader's end, a report
                       that goes backwards, or a topics version the leader never
                       had (the connection is then closed)
REPLICA_METADATA       broker_id, session -> version, topics: {name: queue_count},
                       offset_lists: [[group, topic, [queue_ids], [offsets]], ...]
                       (a row per group and topic; a follower also reads an older
                       leader's offsets: [[group, topic, queue_id, offset], ...]),
                       subscriptions: [[group, mode, [topics]], ...];
                       queue_ends_before (optional: a follower whose log starts
                       empty there) -> also queue_ends: [[topic, queue_id, next], ...]
                       of the queues without a record from there on (retention
                       removed them all): the follower continues them at next
PROMOTE                force (bool, optional) -> epoch. Makes a follower the
                       leader of its group with a new epoch; NOT_IN_SYNC if the
                       follower is not known in sync (force overrides: may lose data).
                       In ZooKeeper mode: a graceful hand-over (TRANSFER_LEADERSHIP
                       from the follower to its leader); force is refused
REPLICA_STATUS         -> role, broker_name, broker_id, epoch, end_offset,
                       confirmed_offset, durable_offset, leader_addr, in_sync,
                       lag_bytes, lag_ms, replicas: [{broker_id, addr, acked_offset,
                       flushed_offset, lag_bytes, lag_ms, in_sync}] (a leader's view),
                       coordination: {mode ("manual" | "zookeeper"), session,
                       leader, epoch, isr, lease_ms_left} (ZooKeeper's view)
TRANSFER_LEADERSHIP    broker_id, timeout_ms -> epoch. Asks a leader (ZooKeeper
                       mode) to hand its group over to the follower broker_id: it
                       refuses new writes (NOT_LEADER, retryable), waits until that
                       follower holds its whole log, then writes the group's state
                       in ZooKeeper; TIMEOUT if the follower does not catch up
=====================  ============================================================

Security (docs/security.md; every request of a server with authentication on is
refused with AUTHENTICATION_REQUIRED until the connection logged in, then checked
against the ACLs: NOT_AUTHORIZED naming the operation and resource)
==========================================================================================
=====================  ============================================================
AUTHENTICATE           mechanism ("SCRAM-SHA-256" | "SCRAM-SHA-512"; first step
                       only), data (bytes: the SCRAM message) -> data (the server's
                       message), done (bool), principal (once done). Two steps:
                       client-first -> server-first, client-final -> server-final.
                       AUTHENTICATION_FAILED (after the server's failure delay) for
                       any failure, saying nothing of which part was wrong
USER_UPSERT            user, credentials: {mechanism: {salt, iterations, stored_key,
                       server_key}} (base64; made by the client: the password never
                       travels) -> version. Adds a user or changes its password
USER_DELETE            user -> version (NOT_FOUND: no such user)
USER_LIST              -> users: [[user, [mechanisms]], ...]
ACL_CREATE             acls: [[resource_type, name, pattern, principal, host,
                       operation, permission], ...] (names: docs/security.md) -> version
ACL_DESCRIBE           filter: the same seven cells, each "" for any (pattern may
                       be "match") -> acls: [[...], ...]
ACL_DELETE             filter -> acls (those removed), version
=====================  ============================================================

Any request may carry ``on_behalf_of``: [principal, host]: a broker forwarding its own
client's request (the Kafka listener's commits to another broker group's leader) asks
for the ACLs to be decided for that client. Only a sender holding CLUSTER_ACTION on the
cluster may; anyone else is refused NOT_AUTHORIZED.

Name server
===========
=====================  ============================================================
REGISTER_BROKER        cluster, broker_name, addr, topics: {name: queue_count},
                       healthy (bool, default true), failure (str: why not),
                       broker_id, role ("leader" | "follower"), epoch (optional),
                       kafka_addr (host:port of its Kafka listener, optional)
                       -> leader_addr, leader_epoch: the group's leader as the name
                       server knows it (the highest epoch claimed); a broker claiming
                       leadership with a lower epoch is recorded as a follower
UNREGISTER_BROKER      addr (broker_name optional)
GET_ROUTE              topic -> brokers: [{broker_name, addr, queue_count, healthy,
                       failure, epoch, leader, followers: [{addr, broker_id}]}] (each
                       group's leader, live: producers skip unhealthy ones, consumers
                       still read from them; followers may serve reads; a group
                       without a live leader is routed to a follower, leader: false,
                       unhealthy)
GET_CLUSTER            -> brokers: [{broker_name, addr, cluster, topics, age_ms,
                       healthy, failure, broker_id, role, epoch, kafka_addr}]
=====================  ============================================================
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Final


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
    DELETE_GROUP = 45
    CONSUMER_SEND_BACK = 46
    LOCK_QUEUES = 47
    UNLOCK_QUEUES = 48
    CREATE_TOPIC = 50
    DELETE_TOPIC = 51
    LIST_TOPICS = 52
    DESCRIBE_TOPIC = 53
    GET_MESSAGE = 54
    CANCEL_MESSAGE = 55
    END_TRANSACTION = 56
    CHECK_TRANSACTIONS = 57
    LIST_TRANSACTIONS = 58
    QUERY_INDEX = 59
    BROKER_INFO = 60
    POP_MESSAGE = 61
    ACK_MESSAGE = 62
    CHANGE_INVISIBLE_TIME = 63
    GET_LOG_LAYOUT = 70
    READ_LOG = 71
    REPLICA_JOIN = 80
    REPLICA_FETCH = 81
    REPLICA_METADATA = 82
    PROMOTE = 83
    REPLICA_STATUS = 84
    TRANSFER_LEADERSHIP = 85
    AUTHENTICATE = 90
    USER_UPSERT = 91
    USER_DELETE = 92
    USER_LIST = 93
    ACL_CREATE = 94
    ACL_DESCRIBE = 95
    ACL_DELETE = 96
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
    UNSUPPORTED_VERSION = 6  # the frame's protocol version is not one the server speaks (text: which it does)
    SHUTTING_DOWN = 7
    TIMEOUT = 8
    TOO_MANY_CONNECTIONS = 9  # the server is at max_connections: it closes this connection (request id 0)
    TOPIC_NOT_FOUND = 17
    INVALID_TOPIC = 18
    INVALID_QUEUE_ID = 19
    MESSAGE_TOO_LARGE = 20
    INVALID_MESSAGE = 21
    FLUSH_DISK_TIMEOUT = 22  # written, not known durable within sync_flush_timeout_ms
    DISK_FULL = 23
    IO_ERROR = 24
    NOT_FOUND = 25  # e.g. no route for a topic, unknown group
    STORE_FAILED = 26  # the broker's store failed (e.g. an fsync error): it takes no produce until restarted
    CORRUPT_DATA = 27  # a record read is damaged (text: file, offset, check); other queues still read
    NOT_LEADER = (
        28  # this broker is a follower: produce, commits and topic changes go to the leader (fields: leader_addr)
    )
    NOT_ENOUGH_REPLICAS = (
        29  # sync acks: fewer than min_insync_replicas in sync; nothing was written. Retry the same queue
    )
    REPLICATION_TIMEOUT = (
        30  # sync acks: stored on the leader, not held by enough replicas in time. Retry the same queue
    )
    STALE_EPOCH = 31  # a request from an older (or newer) leadership term: learn the current leader and epoch
    REPLICA_REFUSED = 32  # a replication request the leader will not serve (unknown replica, lying report)
    OFFSET_OUT_OF_RANGE = 33  # a fetch below the leader's log start (fields: min_offset)
    NOT_IN_SYNC = 34  # PROMOTE of a follower not known in sync (use force to accept losing data)
    GROUP_ACTIVE = 35  # DELETE_GROUP of a group with members connected; HEARTBEAT into a group of Kafka members
    AUTHENTICATION_FAILED = 36  # a login failed (never says whether the user or the password was wrong)
    NOT_AUTHORIZED = 37  # the ACLs do not allow this principal this operation (text: which)
    AUTHENTICATION_REQUIRED = 38  # this server requires a login (AUTHENTICATE) before any other request
    TLS_REQUIRED = 39  # a plaintext connection to a TLS port: told so (request id 0), then closed


# ------------------------------------------------------------- request fields
Check = Callable[[Any], "str | None"]  # why a value is wrong, or None

MAX_QUEUE_ID: Final = 2**31 - 1
# CONSUMER_SEND_BACK's max_reconsume_times: the most a request may ask, and the broker's
# default (RocketMQ's): attempts after the first before a message goes to %DLQ%group.
MAX_RECONSUME_TIMES: Final = 1000
DEFAULT_MAX_RECONSUME_TIMES: Final = 16
MAX_I64: Final = 2**63 - 1


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r:.40}"


def _int(lo: int = 0, hi: int = MAX_I64) -> Check:
    def check(value: Any) -> str | None:
        if type(value) is not int:
            return f"must be an integer, got {_kind(value)}"
        return None if lo <= value <= hi else f"must be in {lo}..{hi}, got {value}"

    return check


def _str(value: Any) -> str | None:
    return None if type(value) is str else f"must be a string, got {_kind(value)}"


def _bool(value: Any) -> str | None:
    return None if type(value) is bool else f"must be a boolean, got {_kind(value)}"


def _list(value: Any) -> str | None:  # rows checked by the handler, in the same pass that uses them
    return None if type(value) is list else f"must be a list, got {_kind(value)}"


def _bytes(value: Any) -> str | None:
    return None if type(value) is bytes else f"must be bytes, got {_kind(value)}"


def _dict(value: Any) -> str | None:
    return None if type(value) is dict else f"must be a map, got {_kind(value)}"


def _strings(value: Any) -> str | None:
    if type(value) is list and all(type(t) is str for t in value):
        return None
    return f"must be a list of strings, got {_kind(value)}"


def _topics(value: Any) -> str | None:
    if type(value) is dict and all(
        type(k) is str and type(v) is int and 0 < v <= MAX_QUEUE_ID for k, v in value.items()
    ):
        return None
    return f"must map topic names to queue counts, got {_kind(value)}"


def _rows(*cells: Check, shape: str) -> Check:
    """A list of fixed-length rows whose cells pass ``cells`` (a small list: groups, offsets)."""

    def check(value: Any) -> str | None:
        if type(value) is not list:
            return f"must be a list of {shape}, got {_kind(value)}"
        n = len(cells)
        for i, row in enumerate(value):  # loops, not a generator per row: a commit carries 65,536 rows
            if type(row) is not list or len(row) != n:
                return f"row {i} must be {shape}, got {row!r:.80}"
            for c, v in zip(cells, row):
                if c(v):
                    return f"row {i} must be {shape}, got {row!r:.80}"
        return None

    return check


def _groups(value: Any) -> str | None:
    if type(value) is not list:
        return f"must be a list of {{group, topics, mode}} maps, got {_kind(value)}"
    for i, g in enumerate(value):
        ok = type(g) is dict and type(g.get("group")) is str and _strings(g.get("topics", [])) is None
        if not ok or g.get("mode", "clustering") not in ("clustering", "broadcasting"):
            return f"item {i} must be {{group: str, topics: [str], mode: clustering|broadcasting}}, got {g!r:.80}"
    return None


def _role(value: Any) -> str | None:
    return None if value in ("leader", "follower") else f"must be 'leader' or 'follower', got {_kind(value)}"


def _action(value: Any) -> str | None:
    return None if value in ("commit", "rollback") else f"must be 'commit' or 'rollback', got {_kind(value)}"


def _start_from(value: Any) -> str | None:
    return None if value in ("earliest", "latest") else f"must be 'earliest' or 'latest', got {_kind(value)}"


def _ints(cell: Check) -> Check:
    def check(value: Any) -> str | None:
        if type(value) is not list or any(cell(v) for v in value):
            return f"must be a list of queue ids, got {_kind(value)}"
        return None

    return check


TOPIC, QUEUE_ID, OFFSET, GROUP = _str, _int(0, MAX_QUEUE_ID), _int(), _str
EPOCH = _int(-1)  # a leadership term; -1: none yet
COUNT = _int(0, MAX_QUEUE_ID)  # a clamped limit: 0 means the least
Spec = dict[str, tuple[Check, bool]]  # field -> (check, required)

REQUEST_FIELDS: Final[dict[int, Spec]] = {
    RequestCode.SEND_MESSAGE: {"topic": (TOPIC, True), "dedup": (_bool, False)},
    RequestCode.PULL_MESSAGE: {
        "topic": (TOPIC, True),
        "queue_id": (QUEUE_ID, True),
        "offset": (OFFSET, True),
        "max_messages": (COUNT, False),
        "max_wait_ms": (_int(), False),
        "tags": (_strings, False),
        "group": (GROUP, False),
    },
    RequestCode.PULL_MESSAGES: {
        "queues": (_list, True),
        "max_messages": (COUNT, False),
        "max_per_queue": (COUNT, False),
        "max_wait_ms": (_int(), False),
        "max_bytes": (_int(1), False),
    },
    RequestCode.QUERY_OFFSETS: {"topic": (TOPIC, True), "queue_id": (QUEUE_ID, True)},
    RequestCode.SEARCH_OFFSET: {"topic": (TOPIC, True), "queue_id": (QUEUE_ID, True), "timestamp_ms": (_int(), True)},
    RequestCode.COMMIT_OFFSET: {
        "group": (GROUP, True),
        "offsets": (_rows(TOPIC, QUEUE_ID, OFFSET, shape="[topic, queue_id, offset]"), True),
    },
    RequestCode.QUERY_CONSUMER_OFFSET: {"group": (GROUP, True), "topic": (TOPIC, True), "queue_id": (QUEUE_ID, True)},
    RequestCode.QUERY_QUEUE_OFFSETS: {"group": (GROUP, True), "queues": (_list, True)},
    RequestCode.HEARTBEAT: {"client_id": (_str, True), "groups": (_groups, True)},
    RequestCode.UNREGISTER_CLIENT: {"client_id": (_str, True)},
    RequestCode.GET_GROUP_MEMBERS: {"group": (GROUP, True)},
    RequestCode.LIST_GROUPS: {},
    RequestCode.DESCRIBE_GROUP: {"group": (GROUP, True)},
    RequestCode.DELETE_GROUP: {"group": (GROUP, True)},
    RequestCode.CREATE_TOPIC: {"topic": (TOPIC, True), "queue_count": (_int(1, MAX_QUEUE_ID), True)},
    RequestCode.DELETE_TOPIC: {"topic": (TOPIC, True)},
    RequestCode.LIST_TOPICS: {"include_system": (_bool, False)},
    RequestCode.CONSUMER_SEND_BACK: {
        "group": (GROUP, True),
        "messages": (_rows(OFFSET, _int(-1), shape="[commitlog_offset, delay_ms]"), True),
        "max_reconsume_times": (_int(0, MAX_RECONSUME_TIMES), False),
        "to_dlq": (_bool, False),
    },
    RequestCode.LOCK_QUEUES: {
        "group": (GROUP, True),
        "client_id": (_str, True),
        "queues": (_rows(TOPIC, QUEUE_ID, shape="[topic, queue_id]"), True),
    },
    RequestCode.UNLOCK_QUEUES: {
        "group": (GROUP, True),
        "client_id": (_str, True),
        "queues": (_rows(TOPIC, QUEUE_ID, shape="[topic, queue_id]"), True),
    },
    RequestCode.CANCEL_MESSAGE: {"commitlog_offset": (OFFSET, True)},
    RequestCode.DESCRIBE_TOPIC: {"topic": (TOPIC, True)},
    RequestCode.GET_MESSAGE: {"commitlog_offset": (OFFSET, True)},
    RequestCode.END_TRANSACTION: {
        "group": (GROUP, True),
        "commitlog_offset": (OFFSET, True),
        "action": (_action, True),
        "from_check": (_bool, False),
    },
    RequestCode.CHECK_TRANSACTIONS: {
        "group": (GROUP, True),
        "client_id": (_str, True),
        "max_messages": (COUNT, False),
        "max_wait_ms": (_int(), False),
    },
    RequestCode.LIST_TRANSACTIONS: {"group": (GROUP, False), "max_messages": (COUNT, False)},
    RequestCode.QUERY_INDEX: {
        "topic": (TOPIC, True),
        "key": (_str, True),
        "since_ms": (_int(), False),
        "until_ms": (_int(), False),
        "max_results": (COUNT, False),
    },
    RequestCode.POP_MESSAGE: {
        "group": (GROUP, True),
        "client_id": (_str, True),
        "topic": (TOPIC, True),
        "invisible_time_ms": (_int(1), True),
        "max_messages": (COUNT, False),
        "max_wait_ms": (_int(), False),
        "tags": (_strings, False),
        "queue_ids": (_ints(QUEUE_ID), False),
        "orderly": (_bool, False),
        "start_from": (_start_from, False),
        "max_reconsume_times": (_int(0, MAX_RECONSUME_TIMES), False),
        "max_bytes": (_int(1), False),
    },
    RequestCode.ACK_MESSAGE: {"group": (GROUP, True), "handles": (_strings, True)},
    RequestCode.CHANGE_INVISIBLE_TIME: {
        "group": (GROUP, True),
        "handles": (_strings, True),
        "invisible_time_ms": (_int(0), True),
    },
    RequestCode.BROKER_INFO: {},
    RequestCode.GET_LOG_LAYOUT: {},
    RequestCode.READ_LOG: {"offset": (OFFSET, True), "max_bytes": (_int(), True), "end_offset": (OFFSET, True)},
    RequestCode.REPLICA_JOIN: {
        "broker_name": (_str, True),
        "broker_id": (_int(), True),
        "epoch": (EPOCH, True),
        "end_offset": (OFFSET, True),
        "segment_bytes": (_int(1), True),
        "addr": (_str, False),
    },
    RequestCode.REPLICA_FETCH: {
        "broker_id": (_int(), True),
        "session": (_int(), True),
        "epoch": (EPOCH, True),
        "offset": (OFFSET, True),
        "flushed": (OFFSET, True),
        "max_bytes": (_int(1), True),
        "max_wait_ms": (_int(), True),
        "topics_version": (_int(-1), False),
    },
    RequestCode.REPLICA_METADATA: {
        "broker_id": (_int(), True),
        "session": (_int(), True),
        "queue_ends_before": (_int(), False),
    },
    RequestCode.PROMOTE: {"force": (_bool, False)},
    RequestCode.REPLICA_STATUS: {},
    RequestCode.TRANSFER_LEADERSHIP: {"broker_id": (_int(), True), "timeout_ms": (_int(), False)},
    RequestCode.AUTHENTICATE: {"mechanism": (_str, False), "data": (_bytes, True)},
    RequestCode.USER_UPSERT: {"user": (_str, True), "credentials": (_dict, True)},
    RequestCode.USER_DELETE: {"user": (_str, True)},
    RequestCode.USER_LIST: {},
    RequestCode.ACL_CREATE: {"acls": (_list, True)},
    RequestCode.ACL_DESCRIBE: {"filter": (_list, True)},
    RequestCode.ACL_DELETE: {"filter": (_list, True)},
    RequestCode.REGISTER_BROKER: {
        "cluster": (_str, False),
        "broker_name": (_str, True),
        "addr": (_str, True),
        "topics": (_topics, True),
        "healthy": (_bool, False),
        "failure": (_str, False),
        "broker_id": (_int(), False),
        "role": (_role, False),
        "epoch": (EPOCH, False),
        "kafka_addr": (_str, False),
    },
    RequestCode.UNREGISTER_BROKER: {"addr": (_str, True), "broker_name": (_str, False)},
    RequestCode.GET_ROUTE: {"topic": (TOPIC, True)},
    RequestCode.GET_CLUSTER: {},
}


def request_error(code: int, fields: dict[str, Any]) -> str | None:
    """Why a request's fields are not what :data:`REQUEST_FIELDS` documents for its
    code (missing, wrong type, out of range), naming the field; None if they are.
    Codes not in the table (unknown requests) are the server's to refuse."""
    for name, (check, required) in REQUEST_FIELDS.get(code, {}).items():
        if name not in fields or (fields[name] is None and not required):
            if required:
                return f"field {name!r} is missing"
            continue
        why = check(fields[name])
        if why is not None:
            return f"field {name!r} {why}"
    return None
