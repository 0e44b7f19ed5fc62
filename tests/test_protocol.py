"""The sans-IO wire protocol: frames, the decoder's state machine, message batches."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.cli.settings import SettingsError, load_settings
from clmq.commitlog import encode_message
from clmq.common import Message
from clmq.protocol import (
    FLAG_RESPONSE,
    NEED_DATA,
    PROTOCOL_VERSION,
    REQUEST_FIELDS,
    SUPPORTED_VERSIONS,
    BatchError,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameRejected,
    ProtocolError,
    RequestCode,
    check_request,
    decode_batch,
    decode_records,
    encode_batch,
    encode_frame,
    request_error,
    set_queue_id,
)

# Every test here runs with the compiled record decoder and with its pure-Python fallback.
pytestmark = pytest.mark.usefixtures("each_decoder")


def events(decoder: FrameDecoder) -> list:
    out = []
    while (ev := decoder.next_event()) is not NEED_DATA:
        out.append(ev)
    return out


def test_frames_round_trip_whole_and_byte_by_byte() -> None:
    frames = [
        Frame(RequestCode.SEND_MESSAGE, 1, {"topic": "t", "n": [1, 2]}, b"body" * 100),
        Frame(RequestCode.PULL_MESSAGE, 2, {}, b"", FLAG_RESPONSE, ErrorCode.TOPIC_NOT_FOUND, "no such topic"),
    ]
    wire = b"".join(encode_frame(f) for f in frames)
    whole = FrameDecoder()
    whole.receive_data(wire)
    assert events(whole) == frames
    trickle, got = FrameDecoder(), []
    for i in range(len(wire)):
        trickle.receive_data(wire[i : i + 1])
        got += events(trickle)
    assert got == frames and got[1].is_response and not got[0].is_response


bodies = st.lists(st.binary(max_size=3000), min_size=1, max_size=8)


@given(bodies=bodies, cuts=st.lists(st.integers(0, 30000), max_size=12), limit=st.sampled_from([2000, 1 << 20]))
@settings(max_examples=100, deadline=None)
def test_any_chunking_of_a_stream_gives_the_same_events(bodies: list[bytes], cuts: list[int], limit: int) -> None:
    """However the stream is cut into chunks, frames come out whole and in order, and
    the ones over the limit as FrameRejected with their request ids."""
    frames = [Frame(RequestCode.SEND_MESSAGE, i, {"topic": "t"}, b) for i, b in enumerate(bodies)]
    wire = b"".join(encode_frame(f) for f in frames)
    dec, got, at = FrameDecoder(max_frame_bytes=limit), [], 0
    for cut in [*sorted(c % (len(wire) + 1) for c in cuts), len(wire)]:
        dec.receive_data(bytearray(wire[at:cut]))  # any bytes-like chunk, as sockets give
        got += events(dec)
        at = max(at, cut)
    fits = [len(encode_frame(f)) <= limit for f in frames]
    assert [(ev.request_id, isinstance(ev, Frame)) for ev in got] == [(f.request_id, ok) for f, ok in zip(frames, fits)]
    assert [ev for ev in got if isinstance(ev, Frame)] == [f for f, ok in zip(frames, fits) if ok]
    assert dec.buffered_bytes == 0


def test_oversized_frame_is_rejected_with_its_request_id_and_the_stream_continues() -> None:
    dec = FrameDecoder(max_frame_bytes=1000)
    big = encode_frame(Frame(RequestCode.SEND_MESSAGE, 7, {"topic": "t"}, b"x" * 5000))
    small = encode_frame(Frame(RequestCode.BROKER_INFO, 8))
    evs = []
    for i in range(0, len(big), 333):  # arrives in pieces: the body is skipped, never buffered
        dec.receive_data(big[i : i + 333])
        evs += events(dec)
        assert dec.buffered_bytes < 1000
    dec.receive_data(small)
    evs += events(dec)
    assert isinstance(evs[0], FrameRejected) and evs[0].request_id == 7 and "max_frame_bytes=1000" in evs[0].reason
    assert evs[1] == Frame(RequestCode.BROKER_INFO, 8)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x01\x00\x00\x00\x00\x00\x00\x00",  # frame length shorter than its header length field
        b"\x08\x00\x00\x00\x04\x00\x00\x00\xc1\xc1\xc1\xc1",  # header is not msgpack
        b"\x08\x00\x00\x00\x04\x00\x00\x00" + msgpack.packb([1, 2])[:4].ljust(4, b"\0"),  # header not a map
    ],
)
def test_garbage_raises_protocol_error_and_the_decoder_stays_dead(garbage: bytes) -> None:
    dec = FrameDecoder()
    dec.receive_data(garbage)
    with pytest.raises(ProtocolError):
        events(dec)
    dec.receive_data(encode_frame(Frame(1, 1)))
    with pytest.raises(ProtocolError):
        dec.next_event()


def test_header_without_code_is_a_protocol_error() -> None:
    header = msgpack.packb({"i": 1})
    dec = FrameDecoder()
    dec.receive_data((4 + len(header)).to_bytes(4, "little") + len(header).to_bytes(4, "little") + header)
    with pytest.raises(ProtocolError, match="lacks 'c'"):
        dec.next_event()


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_fuzzed_bytes_never_crash_the_decoder(data: bytes) -> None:
    dec = FrameDecoder(max_frame_bytes=4096)
    dec.receive_data(data)
    try:
        for ev in events(dec):
            assert isinstance(ev, (Frame, FrameRejected))
    except ProtocolError:
        pass


messages = st.builds(
    Message,
    topic=st.just("t"),
    queue_id=st.integers(0, 1000),
    body=st.binary(max_size=300),
    tags=st.text(max_size=20),
    keys=st.text(max_size=20),
    properties=st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3),
    flags=st.integers(0, 2**32 - 1),
    born_timestamp_ms=st.integers(0, 2**63 - 1),
    born_host=st.just(("10.0.0.1", 5)),
)


@given(st.lists(messages, min_size=1, max_size=20))
@settings(max_examples=100, deadline=None)
def test_batches_round_trip(msgs: list[Message]) -> None:
    assert decode_batch(encode_batch(msgs), "t", ("10.0.0.1", 5)) == msgs
    restamped = decode_batch(set_queue_id(encode_batch(msgs), 42, len(msgs)), "t", ("10.0.0.1", 5))
    assert [m.queue_id for m in restamped] == [42] * len(msgs)


def test_truncated_batch_is_a_clear_error() -> None:
    body = encode_batch([Message("t", 0, b"hello world")])
    with pytest.raises(BatchError, match="runs past the batch"):
        decode_batch(body[:-3], "t", ("0.0.0.0", 0))
    with pytest.raises(BatchError):
        decode_batch(b"\x01\x02\x03", "t", ("0.0.0.0", 0))


def test_pulled_records_are_crc_checked() -> None:
    raw = b"".join(encode_message(Message("t", 0, b"m%d" % i), 100 * i, i, 1) for i in range(3))
    assert [r.body for r in decode_records(raw)] == [b"m0", b"m1", b"m2"]
    bad = bytearray(raw)
    bad[-1] ^= 0xFF
    with pytest.raises(Exception, match="crc32c"):
        decode_records(bytes(bad))


def test_settings_come_from_file_then_environment_then_flags(tmp_path) -> None:
    from clmq.broker.service import BrokerConfig

    cfg = tmp_path / "broker.toml"
    cfg.write_text(
        '[broker]\nbroker_name = "b1"\nlisten_port = 1234\nnamesrv_addrs = ["a:1", "b:2"]\nauto_create_topics = true\n'
    )
    c = load_settings(
        BrokerConfig,
        cfg,
        section="broker",
        env={"CLMQ_LISTEN_PORT": "2000", "CLMQ_FLUSH_MODE": "sync"},
        overrides={"broker_name": "b2", "data_dir": None},
    )
    assert (c.broker_name, c.listen_port, c.flush_mode, c.namesrv_addrs, c.auto_create_topics) == (
        "b2",
        2000,
        "sync",
        ["a:1", "b:2"],
        True,
    )
    cfg.write_text("listen_prot = 1\n")
    with pytest.raises(SettingsError, match=r"unknown setting.*listen_prot"):
        load_settings(BrokerConfig, cfg)
    with pytest.raises(SettingsError, match=r"CLMQ_LISTEN_PORT.*integer"):
        load_settings(BrokerConfig, env={"CLMQ_LISTEN_PORT": "many"})


def test_every_request_code_documents_its_fields_and_a_good_request_passes() -> None:
    assert set(REQUEST_FIELDS) == set(RequestCode)
    assert check_request(Frame(RequestCode.PULL_MESSAGE, 1, {"topic": "t", "queue_id": 0, "offset": 5})) is None
    assert check_request(Frame(RequestCode.LIST_TOPICS, 1, {"a newer client's field": 1})) is None  # ignored


@pytest.mark.parametrize("version", [0, 2, -1, 2**40])
def test_a_request_of_a_version_not_spoken_is_refused_naming_the_versions(version: int) -> None:
    code, text = check_request(Frame(RequestCode.BROKER_INFO, 1, version=version)) or (None, "")
    assert code is ErrorCode.UNSUPPORTED_VERSION
    assert f"version {version} is not supported" in text and "speaks version(s) 1" in text
    assert PROTOCOL_VERSION in SUPPORTED_VERSIONS


def test_a_frame_without_a_version_decodes_as_version_0() -> None:
    header = msgpack.packb({"c": RequestCode.BROKER_INFO, "i": 3, "f": 0})
    decoder = FrameDecoder()
    decoder.receive_data(struct.pack("<II", 4 + len(header), len(header)) + header)
    (frame,) = events(decoder)
    assert frame.version == 0 and check_request(frame) is not None


@given(st.sampled_from(sorted(REQUEST_FIELDS.items())), st.data())
def test_a_field_of_another_type_is_malformed_naming_it(entry: tuple, data: st.DataObject) -> None:
    code, spec = entry
    if not spec:
        return
    name = data.draw(st.sampled_from(sorted(spec)))
    wrong = [1.5, {"x": [1]}, -1, 2**64 - 1]  # wrong for every field
    if (code, name) not in {(RequestCode.AUTHENTICATE, "data")}:
        wrong.append(b"raw")  # bytes are right only where the field is bytes
    bad = data.draw(st.sampled_from(wrong))
    why = request_error(code, {name: bad})
    assert why is not None and (repr(name) in why or "is missing" in why)
