"""Replication settings (the broker's settings of the same names build this)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("leader", "follower")
ACK_MODES = ("async", "sync")
REPLICA_ACKS = ("written", "flushed")


@dataclass(frozen=True)
class ReplicationConfig:
    """How one broker of a group replicates.

    ``role`` is the role at the first start; after a promotion or demotion the role
    recorded in the data directory (``replica-role``) wins. A follower finds its leader
    at ``leader_addr``, or through the name servers (the group's leader) when that is
    empty or no longer the leader.
    """

    broker_name: str = "broker-a"
    broker_id: int = 0  # unique within the group
    role: str = "leader"
    leader_addr: str = ""  # host:port of the leader (followers)
    ack_mode: str = "async"  # "sync": a produce is acknowledged once min_insync_replicas hold it
    topic_ack_modes: dict[str, str] = field(default_factory=dict)  # per-topic override of ack_mode
    min_insync_replicas: int = 1  # replicas (leader included) that must hold a sync write
    replica_ack: str = "written"  # what a follower's "hold" means: "written" (page cache) or "flushed" (fsynced)
    replication_timeout_ms: int = 5000  # a sync write not held by enough replicas by then: REPLICATION_TIMEOUT
    replica_lag_max_ms: int = 5000  # a follower not caught up for this long leaves the in-sync set
    replica_fetch_max_bytes: int = 4 << 20  # one fetch answer at most (a bigger record is fetched whole)
    replica_fetch_wait_ms: int = 500  # a fetch at the leader's end waits this long for new bytes
    replica_catchup_bytes_per_s: int = 256 << 20  # per follower catching up, out of the in-sync set (0: unlimited)
    replica_ids: tuple[int, ...] = ()  # ids allowed to replicate from the leader (empty: any id of the group)
    replica_metadata_interval_ms: int = 1000  # a follower copies topics and consumer offsets at most this often
    replica_retry_ms: int = 500  # a follower that lost its leader tries again after this
    coordinated: bool = False  # ZooKeeper decides the roles (broker.coordination); role/leader_addr are ignored
    leader_transfer_timeout_ms: int = 5000  # a graceful hand-over waits this long for the follower to catch up

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("role", self.role, ROLES),
            ("ack_mode", self.ack_mode, ACK_MODES),
            ("replica_ack", self.replica_ack, REPLICA_ACKS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        for topic, mode in self.topic_ack_modes.items():
            if mode not in ACK_MODES:
                raise ValueError(f"topic_ack_modes[{topic!r}] must be one of {', '.join(ACK_MODES)}, got {mode!r}")
        if self.min_insync_replicas < 1:
            raise ValueError(f"min_insync_replicas must be at least 1 (the leader), got {self.min_insync_replicas}")
        if self.broker_id < 0:
            raise ValueError(f"broker_id must not be negative, got {self.broker_id}")

    def ack_mode_of(self, topic: str) -> str:
        return self.topic_ack_modes.get(topic, self.ack_mode)
