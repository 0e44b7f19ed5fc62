"""Leader epochs, divergence and the in-sync set, as plain data (no brokers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.replication import FollowerState, InSyncSet, LeaderEpochs, divergence
from clmq.broker.replication._epochs import Entry
from clmq.common import MetadataError


# ------------------------------------------------------------------ divergence
def _writer(terms: list[Entry], end: int, x: int) -> tuple[int, int] | None:
    """Which term wrote offset ``x`` of a log with these terms ending at ``end``."""
    if x >= end:
        return None
    found = None
    for epoch, start, leader in terms:
        if start <= x:
            found = (epoch, leader)
    return found


@st.composite
def two_histories(draw: st.DrawFn) -> tuple[list[Entry], int, list[Entry], int]:
    """A shared history of terms, then each side's own terms (new leaders, so new
    (epoch, leader) names even where epochs collide), and each log's end. A log's
    first term starts at its first byte (a first leader claims what it holds)."""
    starts = sorted(draw(st.lists(st.integers(0, 60), min_size=0, max_size=4)))
    starts = [0, *starts[1:]] if starts else []
    common: list[Entry] = [(i, s, i % 3) for i, s in enumerate(starts)]
    base_epoch = len(common)
    floor = starts[-1] if starts else 0

    def own_terms(first_id: int) -> list[Entry]:
        extra = sorted(draw(st.lists(st.integers(floor, 100), max_size=3)))
        if extra and not starts:
            extra[0] = 0
        epochs = sorted(
            draw(st.sets(st.integers(base_epoch, base_epoch + 6), min_size=len(extra), max_size=len(extra)))
        )
        return [(e, s, first_id + i) for i, (e, s) in enumerate(zip(epochs, extra))]

    own, lead = common + own_terms(10), common + own_terms(20)
    own_end = draw(st.integers(own[-1][1] if own else 0, 120))
    lead_end = draw(st.integers(lead[-1][1] if lead else 0, 120))
    return own, own_end, lead, lead_end


@settings(max_examples=400, deadline=None)
@given(two_histories())
def test_divergence_keeps_exactly_the_prefix_both_logs_wrote_in_the_same_terms(
    h: tuple[list[Entry], int, list[Entry], int],
) -> None:
    own, own_end, lead, lead_end = h
    cut = divergence(own, own_end, lead, lead_end)
    agree = 0
    while agree < min(own_end, lead_end) and _writer(own, own_end, agree) == _writer(lead, lead_end, agree) is not None:
        agree += 1
    if not own:
        assert cut == 0  # a log without terms keeps nothing
    else:
        assert cut == agree, (own, own_end, lead, lead_end)


def test_a_restarted_old_leader_with_the_same_epoch_as_the_promoted_one_is_cut_at_the_promotion() -> None:
    """A (id 1) wrote to 100 in epoch 1; B (id 2) was promoted at 80 with epoch 2 and
    wrote on; A restarted and took epoch 2 too: the id tells the two terms apart."""
    a = [(1, 0, 1), (2, 100, 1)]
    b = [(1, 0, 1), (2, 80, 2)]
    assert divergence(a, 120, b, 150) == 80


# --------------------------------------------------------------------- epochs
def test_epochs_persist_and_keep_their_order(tmp_path: Path) -> None:
    epochs = LeaderEpochs.load(tmp_path)
    assert epochs.latest == -1 and epochs.entries == []
    epochs.start(0, 0, 1)
    epochs.start(3, 500, 2)
    assert LeaderEpochs.load(tmp_path).entries == [(0, 0, 1), (3, 500, 2)]
    with pytest.raises(AssertionError):
        epochs.start(3, 600, 1)  # not newer
    epochs.truncate(400)  # the term that started at 500 never wrote here
    assert LeaderEpochs.load(tmp_path).entries == [(0, 0, 1)]


def test_adopting_a_leaders_terms_takes_those_the_log_has_reached(tmp_path: Path) -> None:
    epochs = LeaderEpochs.load(tmp_path)
    leader = [(0, 0, 1), (2, 300, 2), (5, 900, 3)]
    epochs.adopt(leader, 350)
    assert epochs.entries == [(0, 0, 1), (2, 300, 2)]
    epochs.catch_up(leader, 899)
    assert len(epochs.entries) == 2
    epochs.catch_up(leader, 900)
    assert LeaderEpochs.load(tmp_path).entries == leader


def test_damaged_epochs_refuse_to_load_naming_the_file(tmp_path: Path) -> None:
    LeaderEpochs.load(tmp_path).start(0, 0, 1)
    for name in ("leader-epochs", "leader-epochs.prev"):
        if (tmp_path / name).exists():
            (tmp_path / name).write_bytes(b"garbage")
    with pytest.raises(MetadataError, match="leader-epochs"):
        LeaderEpochs.load(tmp_path)


# ---------------------------------------------------------------- in-sync set
def _follower(broker_id: int = 1) -> FollowerState:
    return FollowerState(broker_id, "127.0.0.1:1", session=7, joined_ms=0)


def test_a_follower_joins_once_caught_up_and_leaves_after_lagging_too_long() -> None:
    isr = InSyncSet("g", lag_max_ms=1000, count_flushed=False, confirmed=0)
    f = _follower()
    isr.join(f)
    isr.report(f, 0, 0, leader_end=500, now_ms=10)  # behind: not in sync
    assert not f.in_sync and isr.size() == 1
    isr.answered(f, reached=500, leader_end=500, now_ms=11)  # the answer reached the end
    isr.report(f, 500, 0, leader_end=800, now_ms=20)  # holds it: caught up as of the answer
    assert f.in_sync and isr.size() == 2 and f.caught_up_ms == 11
    assert isr.expire(now_ms=900) == []
    isr.answered(f, reached=900, leader_end=1000, now_ms=950)  # a partial answer: not caught up
    isr.report(f, 900, 0, leader_end=1500, now_ms=960)
    assert isr.expire(now_ms=1012) == [f] and not f.in_sync


def test_the_confirmed_offset_is_the_least_hold_and_never_goes_back() -> None:
    isr = InSyncSet("g", lag_max_ms=1000, count_flushed=True, confirmed=0)
    a, b = _follower(1), _follower(2)
    for f in (a, b):
        isr.join(f)
        isr.report(f, 100, 100, leader_end=100, now_ms=1)
    assert isr.recompute(leader_end=300) == 100
    isr.report(a, 300, 250, leader_end=300, now_ms=2)  # counts flushed bytes only
    isr.report(b, 300, 300, leader_end=300, now_ms=2)
    assert isr.recompute(leader_end=300) == 250
    isr.drop(1)
    assert isr.recompute(leader_end=300) == 300
    isr.join(_follower(1))  # a new session, not in sync: does not pull it back
    assert isr.recompute(leader_end=300) == 300


def test_a_frozen_set_keeps_its_followers_however_long_they_lag() -> None:
    isr = InSyncSet("g", lag_max_ms=100, count_flushed=False, confirmed=0)
    f = _follower()
    isr.join(f)
    isr.report(f, 500, 0, leader_end=500, now_ms=10)
    isr.frozen = True  # the leader stops
    assert isr.expire(now_ms=10_000) == [] and f.in_sync and isr.size() == 2


def test_coordinated_set_seeds_zookeepers_members_and_keeps_them_across_sessions() -> None:
    """ZooKeeper mode: a follower leaves only through ZooKeeper (lagging, then leave),
    never because its session ended or it re-joined."""
    isr = InSyncSet("g", lag_max_ms=1000, count_flushed=False, confirmed=300, coordinated=True)
    isr.seed([1, 2], now_ms=0)
    assert isr.size() == 3 and isr.recompute(leader_end=400) == 300  # holds unknown: nothing more confirmed
    new = _follower(1)
    isr.join(new)  # its first session of this term: still in sync, hold unknown
    assert new.in_sync and isr.ready_to_record({0}, topics_version=0) == []
    isr.report(new, 400, 0, leader_end=400, now_ms=5)
    assert isr.ready_to_record({0}, topics_version=0) == []  # the leader's topics not copied yet
    new.topics_version = 0
    assert isr.ready_to_record({0}, topics_version=0) == [1]  # holds every confirmed byte and the topics
    isr.drop(1)  # a refused report or a closed session: waited for until ZooKeeper drops it
    assert isr.followers[1].in_sync and isr.followers[1].acked == -1 and isr.size() == 3
    assert sorted(f.broker_id for f in isr.lagging(now_ms=1500)) == [1, 2]  # proposed, not applied
    assert isr.size() == 3
    for f in isr.lagging(now_ms=1500):
        isr.leave(f, now_ms=1500)
    assert isr.size() == 1


def test_reports_must_not_go_backwards_or_past_the_end() -> None:
    isr = InSyncSet("g", lag_max_ms=1000, count_flushed=False, confirmed=0)
    f = _follower()
    isr.join(f)
    isr.report(f, 50, 10, leader_end=100, now_ms=1)
    for offset, flushed, end in ((40, 10, 100), (150, 10, 100), (60, 70, 100)):
        with pytest.raises(AssertionError):
            isr.report(f, offset, flushed, leader_end=end, now_ms=2)
