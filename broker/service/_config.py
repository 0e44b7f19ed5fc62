"""The broker's settings (TOML file, ``CLMQ_*`` environment variables, flags). Every
limit carries its unit in its name."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from clmq.broker.coordination import split_connect
from clmq.broker.replication import ReplicationConfig
from clmq.broker.store import STORAGE_MODES, StoreConfig
from clmq.commitlog import CommitLogConfig, FlushMode
from clmq.common import GiB, MiB
from clmq.protocol import DEFAULT_MAX_RECONSUME_TIMES, MAX_RECONSUME_TIMES
from clmq.protocol.auth import check_principal
from clmq.protocol.transport import ServerLimits, TlsSettings, exposure_problem, tls_settings_of

# RocketMQ's default delay levels from level 3 (its retries start there): 10 s ... 2 h.
DEFAULT_RETRY_DELAYS_MS = tuple(
    s * 1000 for s in (10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200)
)


@dataclass
class BrokerConfig:
    broker_name: str = "broker-a"
    cluster: str = "DefaultCluster"
    listen_host: str = "127.0.0.1"
    listen_port: int = 10911  # 0: any free port
    advertised_host: str = ""  # the host clients are told to connect to (default: listen_host)
    namesrv_addrs: list[str] = field(default_factory=list)  # "host:port" of every name server
    data_dir: str = "clmq-data"
    storage_mode: str = "commitlog"  # or "partition-per-file"
    flush_mode: str = "async"  # "sync": acknowledge produce only once fsynced (group commit)
    flush_interval_ms: int = 500
    sync_flush_timeout_ms: int = 5000
    segment_bytes: int = GiB
    max_message_bytes: int = 4 * MiB
    retention_ms: int = 72 * 3600 * 1000
    max_frame_bytes: int = 64 * MiB
    max_pull_messages: int = 4096
    max_pull_bytes: int = 8 * MiB
    max_pull_wait_ms: int = 30_000
    pull_read_threads: int = (
        4  # worker threads reading the store for pulls: a slow disk read holds up pulls, not the event loop
    )
    cold_read_threads: int = (
        2  # worker threads for pulls of data not in the page cache: they never occupy pull_read_threads
    )
    cold_read_memory_queues: int = (
        4096  # queue positions remembered as cold (their next pull goes straight to the cold threads)
    )
    cold_read_distance_bytes: int = 256 * MiB  # no page-cache check here: this far before its file's end is cold
    max_inflight_produce_bytes: int = 256 * MiB  # beyond this, producers get SYSTEM_BUSY
    inline_append_max_bytes: int = 64 * 1024  # smaller appends run on the event loop, not in a thread
    max_inflight_per_connection: int = 16_384  # a consumer of 10,000 queues holds a long poll for each
    register_interval_ms: int = 3000
    client_expiry_ms: int = 30_000  # a consumer silent this long leaves its groups
    idle_timeout_ms: int = 120_000  # a connection with no request in flight (long polls count) is closed after this
    # Limits at the door (the name server has the same ones, at these defaults):
    max_connections: int = 10_000  # one more is told TOO_MANY_CONNECTIONS and closed; one log line per burst
    reserved_file_descriptors: int = 128  # connections stop this far below the descriptor limit (ulimit -n)
    max_connection_buffer_bytes: int = (
        64 * MiB
    )  # request bytes one connection holds; beyond: not read (>= max_frame_bytes)
    max_buffered_request_bytes: int = 256 * MiB  # request bytes all connections hold; beyond: not read
    frame_timeout_ms: int = 60_000  # a frame begun must arrive whole within this, or its connection is closed
    max_connection_send_buffer_bytes: int = 32 * MiB  # unwritten replies of a connection; beyond: its requests not read
    request_timeout_ms: int = 30_000
    offset_flush_interval_ms: int = 1000
    shutdown_timeout_ms: int = 5000
    auto_create_topics: bool = False
    default_queue_count: int = 8
    # Replication (docs/replication.md). Brokers with the same broker_name form a group.
    broker_id: int = 0  # unique within the group
    role: str = "leader"  # at the first start; later the role of the last promotion/demotion (kept in the data dir)
    leader_addr: str = ""  # a follower's leader (host:port); the name servers' word wins once they know the group
    ack_mode: str = "async"  # "sync": a produce is acknowledged once every in-sync replica holds it
    topic_ack_modes: dict[str, str] = field(default_factory=dict)  # per-topic ack_mode, e.g. {"orders": "sync"}
    min_insync_replicas: int = 1  # sync writes are refused while fewer replicas (leader included) are in sync
    replica_ack: str = "written"  # a follower holds bytes once "written" or once "flushed" (fsynced)
    replication_timeout_ms: int = 5000  # a sync write not held in time: REPLICATION_TIMEOUT (retryable)
    replica_lag_max_ms: int = 5000  # a follower not caught up for this long leaves the in-sync set
    replica_fetch_max_bytes: int = 4 * MiB
    replica_fetch_wait_ms: int = 500
    replica_catchup_bytes_per_s: int = 256 * MiB  # per follower catching up, out of the in-sync set (0: unlimited)
    replica_ids: list[int] = field(default_factory=list)  # ids allowed to replicate (empty: any of the group)
    replica_metadata_interval_ms: int = 1000
    replica_retry_ms: int = 500
    # A leader with in-sync followers tells a consumer this far behind (messages) in a
    # queue to read from a follower (RocketMQ's slave read: old data is cold and costs
    # the leader disk reads that producers wait behind); 0: never.
    follower_read_lag_messages: int = 100_000
    # A producer's retry after an unknown outcome (dedup: true) is answered with the
    # offsets of the copy already stored, if the queue's tail holds it (by UNIQ_KEY):
    dedup_window_ms: int = 120_000  # looked back this far by store time at most
    dedup_max_messages: int = 10_000  # and through this many of the queue's last messages at most
    dedup_catch_up_timeout_ms: int = 5000  # waited for the queues to show the whole log; then SYSTEM_BUSY (retryable)
    # Automatic failover (docs/replication.md): ZooKeeper elects each group's leader
    # among its in-sync replicas; role and leader_addr are then ignored.
    zookeeper: str = ""  # "host:port[,host:port...][/chroot]"; empty: manual mode
    zk_session_timeout_ms: int = 2000  # a dead leader is replaced about this long after it stops answering
    unclean_leader_election: bool = False  # elect a replica out of the in-sync set when none is left: LOSES DATA
    leader_transfer_timeout_ms: int = 5000  # a graceful hand-over waits this long for the follower to catch up
    # Observability (issue 18): Prometheus metrics over HTTP (GET /metrics).
    metrics_port: int = -1  # -1: no metrics port; 0: any free port
    metrics_host: str = ""  # "": 127.0.0.1 (loopback); elsewhere needs auth_enabled (a login) or allow_anonymous
    describe_size_max_entries: int = 1_000_000  # DESCRIBE_TOPIC sums a queue's bytes up to this many messages (else -1)
    # Redelivery (docs/consuming.md): retries, dead letters, scheduled messages, orderly locks.
    # A group's back-off per attempt (RocketMQ's delay levels from 10 s); a consumer may send its own.
    retry_delays_ms: list[int] = field(default_factory=lambda: list(DEFAULT_RETRY_DELAYS_MS))
    # Attempts after the first before a message goes to %DLQ%group (a consumer may send its own).
    max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES
    timer_max_delay_ms: int = 7 * 24 * 3600 * 1000  # a scheduled message due later than this is refused
    timer_tick_ms: int = 100  # how often the timer looks for due messages (its precision)
    timer_checkpoint_interval_ms: int = 1000  # what the timer delivered is recorded this often (after a log flush)
    timer_deliver_batch_messages: int = 1024  # due messages appended per store call
    timer_cancel_margin_ms: int = 2000  # a message due sooner than this can no longer be cancelled
    lock_lease_ms: int = 30_000  # an orderly consumer's queue lock lasts this long unless renewed
    # Transactional messages (docs/transactions.md), RocketMQ's model: half, op, check-back.
    transaction_timeout_ms: int = 6000  # a half message not ended this long after storing is checked back
    transaction_check_interval_ms: int = 1000  # how often the checker looks; an unanswered check is asked again after
    # Checks at most (a look at a due half while no producer of its group polls counts as one,
    # as RocketMQ's: orphans end); then transaction_unresolved decides (and a log line).
    transaction_check_max: int = 15
    # A group none of whose producers polled CHECK_TRANSACTIONS for this long (or since this
    # leader started) has no producer: each look at one of its due halves counts as a check.
    transaction_orphan_after_ms: int = 60_000
    transaction_unresolved: str = "rollback"  # after transaction_check_max checks: "rollback" or "keep" (stay pending)
    transaction_max_pending: int = 1_000_000  # half messages pending at once; one more is refused SYSTEM_BUSY
    transaction_checkpoint_interval_ms: int = 1000  # what the checker knows is recorded this often (after a flush)
    # The key index (docs/operations.md): messages by key and UNIQ_KEY over the whole retained log.
    index_enabled: bool = True  # commitlog mode: the dispatcher also writes the key index
    # Hash slots per index file (4 B each; the active file's table is rewritten and synced with every full
    # checkpoint, so its size is a pause of the log's group commits then: 4 MB, not 20 MB)
    index_hash_slots: int = 1_000_000
    index_max_entries_per_file: int = 4_000_000  # entries per index file (20 B each; 4 a slot); then a new file
    index_query_max_results: int = 1000  # a QUERY_INDEX answers at most this many matches
    index_batch_interval_ms: int = 20  # the index is fed in batches: dispatched records wait at most this long ...
    index_batch_bytes: int = 1 << 20  # ... or until this many bytes of log wait (0 ms: every dispatch round)
    index_query_catch_up_bytes: int = 8 << 20  # a look-up indexes at most this much of what failed index writes left
    # Message traces (docs/traces.md): events of a message's life in topic %TRACE%.
    trace_enabled: bool = False  # the broker records stored, sent back, dead-lettered, committed events
    trace_retention_ms: int = (
        7 * 24 * 3600 * 1000
    )  # lookups show no trace event older than this (the bytes go with the log's segments)
    # An event-loop step this long or longer is a stall: logged, counted (docs/operations.md); 0: not timed
    stall_threshold_ms: int = 10
    # The GIL's switch interval while a broker runs (sys.setswitchinterval; never raised): a
    # thread back from fdatasync, or the loop back from epoll, waits this long at most for a
    # thread running Python (the interpreter's 5 ms made sync-flush answers wait 5 ms).
    gil_switch_interval_us: int = 500
    # POP consumption (docs/consuming.md): per-message acknowledgement, any number of members.
    pop_invisible_time_max_ms: int = 12 * 3600 * 1000  # a longer invisible_time_ms is refused (MALFORMED_REQUEST)
    pop_max_messages: int = 1024  # one POP_MESSAGE takes at most this many messages
    pop_max_handles_per_request: int = 4096  # more in one ACK_MESSAGE / CHANGE_INVISIBLE_TIME: MALFORMED_REQUEST
    # Messages of one group in flight (popped, not yet acknowledged) per queue; a queue at the
    # limit gives that group nothing more until its oldest settle (Kafka's share-partition record locks).
    pop_max_inflight_per_queue: int = 2000
    pop_revive_interval_ms: int = 100  # how often a leader looks for deliveries past their invisible time
    pop_checkpoint_interval_ms: int = 1000  # the in-flight set is recorded this often (after a log flush)
    pop_member_timeout_ms: int = 30_000  # a client not popping for this long is no longer listed as a member
    pop_max_wait_ms: int = 30_000  # a POP_MESSAGE's max_wait_ms is cut to this
    # A group with nothing in flight that has not popped for this long: its POP state goes (its
    # settled offsets committed first: a later pop starts from them).
    pop_group_idle_forget_ms: int = 7 * 24 * 3600 * 1000
    # The Kafka listener (docs/kafka.md): Kafka's own clients, on the same store.
    kafka_listen_port: int = -1  # -1: no Kafka listener; 0: any free port
    kafka_node_id: int = -1  # this broker's node id for Kafka clients; -1: derived from its Kafka address
    kafka_max_frame_bytes: int = 100 * MiB  # a larger request closes the connection (Kafka's socket.request.max.bytes)
    kafka_max_connections: int = 10_000  # one more is closed at once, with one log line per burst
    kafka_max_inflight_requests: int = 64  # requests of one connection read ahead of their answers
    kafka_idle_timeout_ms: int = 600_000  # a connection with nothing asked for this long is closed
    kafka_max_fetch_wait_ms: int = 30_000  # a Fetch's max_wait_ms is cut to this
    kafka_request_timeout_ms: int = 60_000  # a request not answered by then closes its connection (a stuck handler)
    kafka_fetch_compression: str = "none"  # Fetch answers compressed with: none, gzip, snappy, lz4 or zstd
    kafka_group_min_session_timeout_ms: int = 6000
    kafka_group_max_session_timeout_ms: int = 1_800_000
    kafka_group_initial_rebalance_delay_ms: int = 3000  # the first join of an empty group waits this long for others
    kafka_group_max_size_members: int = 1000
    kafka_max_producer_ids: int = 100_000  # idempotent producers remembered (the oldest idle ones are dropped)
    # Share groups (KIP-932, docs/kafka.md): Kafka's group.share.record.lock.duration.ms,
    # group.share.heartbeat.interval.ms and group.share.session.timeout.ms
    kafka_share_record_lock_duration_ms: int = 30_000  # a ShareFetch's records stay with their member this long
    kafka_share_heartbeat_interval_ms: int = 5000  # share members are told to heartbeat this often
    kafka_share_session_timeout_ms: int = 45_000  # a share member silent this long leaves its group
    kafka_share_max_sessions: int = 10_000  # share sessions open on one broker (Kafka's share session cache size)
    kafka_sasl_mechanisms: list[str] = field(
        default_factory=lambda: ["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"]
    )  # offered to Kafka clients with auth_enabled; PLAIN only ever over TLS
    # Security (docs/security.md): TLS on every listener and outgoing connection; logins
    # (SCRAM, mutual-TLS certificates); ACLs on every request of both protocols.
    tls_cert_file: str = ""  # PEM; with tls_key_file every listener (native, Kafka, metrics) speaks only TLS
    tls_key_file: str = ""
    tls_ca_file: str = ""  # the CA peers' certificates chain to (clients' for mutual TLS; leader's, name servers')
    tls_require_client_cert: bool = False  # mutual TLS: a client without a certificate signed by tls_ca_file is refused
    tls_min_version: str = "1.2"  # "1.2" or "1.3"
    auth_enabled: bool = False  # every connection logs in (SCRAM, or a client certificate naming a user); ACLs decide
    super_users: list[str] = field(default_factory=list)  # principals allowed everything, e.g. ["User:admin"]
    allow_anonymous: bool = False  # needed to listen on a non-loopback address without auth_enabled (warned at start)
    auth_failure_delay_ms: int = 1000  # a failed login is answered this late (slows guessing; counted and logged)
    broker_user: str = ""  # the user this broker logs in as to its leader and the name servers (auth_enabled)
    broker_password: str = field(default="", repr=False)  # better given as CLMQ_BROKER_PASSWORD than in a file
    audit_log: str = (
        ""  # JSON lines of admin actions and denials; "": <data_dir>/audit.log with auth_enabled; "-": none
    )
    zk_auth: str = field(
        default="", repr=False
    )  # "user:password": ZooKeeper digest auth, and clmq's znodes readable and writable by it alone

    def __post_init__(self) -> None:
        _check_settings(self)

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics listens: ``metrics_host``, or loopback."""
        return self.metrics_host or "127.0.0.1"

    def tls_settings(self) -> TlsSettings | None:
        """TLS of every listener and of the broker's own connections (same certificate and CA); None: plaintext."""
        return tls_settings_of(self)

    def replication_config(self) -> ReplicationConfig:
        """The broker's replication settings."""
        return ReplicationConfig(
            broker_name=self.broker_name,
            broker_id=self.broker_id,
            role=self.role,
            leader_addr=self.leader_addr,
            ack_mode=self.ack_mode,
            topic_ack_modes=dict(self.topic_ack_modes),
            min_insync_replicas=self.min_insync_replicas,
            replica_ack=self.replica_ack,
            replication_timeout_ms=self.replication_timeout_ms,
            replica_lag_max_ms=self.replica_lag_max_ms,
            replica_fetch_max_bytes=self.replica_fetch_max_bytes,
            replica_fetch_wait_ms=self.replica_fetch_wait_ms,
            replica_catchup_bytes_per_s=self.replica_catchup_bytes_per_s,
            replica_ids=tuple(self.replica_ids),
            replica_metadata_interval_ms=self.replica_metadata_interval_ms,
            replica_retry_ms=self.replica_retry_ms,
            coordinated=bool(self.zookeeper),
            leader_transfer_timeout_ms=self.leader_transfer_timeout_ms,
        )

    def server_limits(self) -> ServerLimits:
        """The limits of the broker's RpcServer."""
        return ServerLimits(
            max_connections=self.max_connections,
            reserved_file_descriptors=self.reserved_file_descriptors,
            max_connection_buffer_bytes=self.max_connection_buffer_bytes,
            max_buffered_request_bytes=self.max_buffered_request_bytes,
            frame_timeout_ms=self.frame_timeout_ms,
            max_connection_send_buffer_bytes=self.max_connection_send_buffer_bytes,
        )

    @property
    def advertised_addr_host(self) -> str:
        return self.advertised_host or self.listen_host

    def store_config(self) -> StoreConfig:
        try:
            ipaddress.ip_address(self.advertised_addr_host)
            store_host = (self.advertised_addr_host, self.listen_port)
        except ValueError:  # a host name: records carry addresses only
            store_host = ("0.0.0.0", self.listen_port)
        log = CommitLogConfig(
            segment_bytes=self.segment_bytes,
            max_message_bytes=self.max_message_bytes,
            flush_mode=FlushMode(self.flush_mode),
            flush_interval_ms=self.flush_interval_ms,
            sync_flush_timeout_ms=self.sync_flush_timeout_ms,
            retention_ms=self.retention_ms,
            store_host=store_host,
        )
        return StoreConfig(
            Path(self.data_dir),
            log,
            storage_mode=self.storage_mode,
            auto_create_topics=self.auto_create_topics,
            default_queue_count=self.default_queue_count,
            index_enabled=self.index_enabled,
            index_hash_slots=self.index_hash_slots,
            index_max_entries_per_file=self.index_max_entries_per_file,
            index_batch_interval_ms=self.index_batch_interval_ms,
            index_batch_bytes=self.index_batch_bytes,
            index_query_catch_up_bytes=self.index_query_catch_up_bytes,
        )


def _check_security(self: BrokerConfig) -> None:
    """The security settings: no open listener on another machine's reach unless meant."""
    what = f"broker {self.broker_name}"
    problem = exposure_problem(what, self.listen_host, self.auth_enabled, self.allow_anonymous)
    if self.metrics_port >= 0:
        problem = problem or exposure_problem(
            f"{what}'s metrics", self.metrics_bind_host, self.auth_enabled, self.allow_anonymous
        )
    if problem:
        raise ValueError(problem)
    for principal in self.super_users:
        check_principal(principal)
    if self.auth_failure_delay_ms < 0:
        raise ValueError(f"auth_failure_delay_ms must be at least 0, got {self.auth_failure_delay_ms}")
    if self.zk_auth and (":" not in self.zk_auth or self.zk_auth.startswith(":")):
        raise ValueError("zk_auth must be 'user:password' (ZooKeeper digest auth)")
    if bool(self.broker_user) != bool(self.broker_password):
        raise ValueError("broker_user and broker_password go together (CLMQ_BROKER_PASSWORD for the password)")


def _check_settings(self: BrokerConfig) -> None:
    """Every setting in range, and settings that cannot work together refused (a ValueError naming them)."""
    if self.flush_mode not in {m.value for m in FlushMode}:
        raise ValueError(f"flush_mode must be one of {', '.join(m.value for m in FlushMode)}, got {self.flush_mode!r}")
    if self.storage_mode not in STORAGE_MODES:
        raise ValueError(f"storage_mode must be one of {', '.join(STORAGE_MODES)}, got {self.storage_mode!r}")
    self.server_limits().check(self.max_frame_bytes)  # a ValueError naming the settings
    self.replication_config()  # a ValueError naming the setting
    if self.storage_mode != "commitlog" and (self.role == "follower" or self.min_insync_replicas > 1):
        raise ValueError(
            "role = follower and min_insync_replicas > 1 need storage_mode = commitlog: "
            "replication copies the CommitLog"
        )
    if self.zookeeper:
        split_connect(self.zookeeper)  # a ValueError naming the setting
    if self.zookeeper and self.storage_mode != "commitlog":
        raise ValueError(
            "zookeeper (automatic failover) needs storage_mode = commitlog: replication copies the CommitLog"
        )
    if self.zk_session_timeout_ms < 1000:
        raise ValueError(f"zk_session_timeout_ms must be at least 1000, got {self.zk_session_timeout_ms}")
    if not 0 <= self.listen_port <= 65535:  # 0: any free port
        raise ValueError(f"listen_port must be in 0..65535 (0: any free port), got {self.listen_port}")
    if not -1 <= self.kafka_listen_port <= 65535:
        raise ValueError(
            f"kafka_listen_port must be in -1..65535 (-1: none, 0: any free), got {self.kafka_listen_port}"
        )
    if self.kafka_request_timeout_ms <= self.kafka_max_fetch_wait_ms:
        raise ValueError(
            "kafka_request_timeout_ms must be above kafka_max_fetch_wait_ms (a long poll is no stuck request)"
        )
    if self.kafka_fetch_compression not in ("none", "gzip", "snappy", "lz4", "zstd"):
        raise ValueError(
            f"kafka_fetch_compression must be none, gzip, snappy, lz4 or zstd, got {self.kafka_fetch_compression!r}"
        )
    if self.kafka_group_max_session_timeout_ms < self.kafka_group_min_session_timeout_ms:
        raise ValueError("kafka_group_max_session_timeout_ms must be at least kafka_group_min_session_timeout_ms")
    if self.kafka_group_initial_rebalance_delay_ms < 0:
        raise ValueError("kafka_group_initial_rebalance_delay_ms must be at least 0")
    if not -1 <= self.kafka_node_id <= 2**31 - 1:
        raise ValueError(f"kafka_node_id must be in -1..2147483647 (-1: derived), got {self.kafka_node_id}")
    if not -1 <= self.metrics_port <= 65535:
        raise ValueError(f"metrics_port must be in -1..65535 (-1: none, 0: any free port), got {self.metrics_port}")
    for name in (
        "pull_read_threads",
        "cold_read_threads",
        "cold_read_memory_queues",
        "cold_read_distance_bytes",
        "describe_size_max_entries",
        "timer_tick_ms",
        "timer_checkpoint_interval_ms",
        "timer_deliver_batch_messages",
        "timer_max_delay_ms",
        "lock_lease_ms",
        "kafka_max_frame_bytes",
        "kafka_max_connections",
        "kafka_max_inflight_requests",
        "kafka_idle_timeout_ms",
        "kafka_max_fetch_wait_ms",
        "kafka_group_min_session_timeout_ms",
        "kafka_group_max_size_members",
        "kafka_max_producer_ids",
    ):
        if getattr(self, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    _check_security(self)
    if (tls := self.tls_settings()) is not None:  # a ValueError naming the file or setting
        tls.server_context()  # the certificate and key load, and match
    if not self.retry_delays_ms or any(type(d) is not int or d < 0 for d in self.retry_delays_ms):
        raise ValueError(f"retry_delays_ms must be a non-empty list of milliseconds >= 0, got {self.retry_delays_ms!r}")
    if not 0 <= self.max_reconsume_times <= MAX_RECONSUME_TIMES:
        raise ValueError(f"max_reconsume_times must be in 0..{MAX_RECONSUME_TIMES}, got {self.max_reconsume_times}")
    _check_features(self)


def _check_features(self: BrokerConfig) -> None:
    """Transactions, the key index and traces."""
    for name in (
        "transaction_timeout_ms",
        "transaction_check_interval_ms",
        "transaction_check_max",
        "transaction_orphan_after_ms",
        "transaction_max_pending",
        "transaction_checkpoint_interval_ms",
        "pop_invisible_time_max_ms",
        "pop_max_messages",
        "pop_max_handles_per_request",
        "pop_max_inflight_per_queue",
        "pop_revive_interval_ms",
        "pop_checkpoint_interval_ms",
        "pop_member_timeout_ms",
        "pop_max_wait_ms",
        "pop_group_idle_forget_ms",
        "kafka_share_record_lock_duration_ms",
        "kafka_share_heartbeat_interval_ms",
        "kafka_share_session_timeout_ms",
        "kafka_share_max_sessions",
        "index_hash_slots",
        "index_max_entries_per_file",
        "index_query_max_results",
        "index_batch_bytes",
        "index_query_catch_up_bytes",
        "trace_retention_ms",
        "gil_switch_interval_us",
    ):
        if getattr(self, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
    if self.index_batch_interval_ms < 0:
        raise ValueError(
            f"index_batch_interval_ms must be at least 0 (0: every round), got {self.index_batch_interval_ms}"
        )
    if self.stall_threshold_ms < 0:
        raise ValueError(f"stall_threshold_ms must be at least 0 (0: off), got {self.stall_threshold_ms}")
    if self.transaction_unresolved not in ("rollback", "keep"):
        raise ValueError(f"transaction_unresolved must be 'rollback' or 'keep', got {self.transaction_unresolved!r}")
    if self.index_hash_slots > 2**31 - 1 or self.index_max_entries_per_file > 2**31 - 1:
        raise ValueError("index_hash_slots and index_max_entries_per_file must be below 2**31 (4-byte slot links)")
