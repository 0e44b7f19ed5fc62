"""Records to Arrow, column by column: numpy over the chunk's bytes, no Python per row
except for the rare record that has properties.

Variable-length fields (topic, tags, keys, body) are cut out of the chunk by Arrow
itself: the chunk is viewed as one binary array whose elements alternate between a
field and the gap to the next field, and ``take`` of the even elements copies just the
fields, in C++. A narrower schema builds only the columns it names.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa

from clmq.common import HEADER_SIZE, decode_host, decode_properties

TS = pa.timestamp("us", tz="UTC")

# name -> (Spark DDL type, Arrow type)
COLUMNS: dict[str, tuple[str, pa.DataType]] = {
    "topic": ("STRING", pa.string()),
    "queue_id": ("INT", pa.int32()),
    "queue_offset": ("BIGINT", pa.int64()),
    "commitlog_offset": ("BIGINT", pa.int64()),
    "tags": ("STRING", pa.string()),
    "keys": ("STRING", pa.string()),
    "properties": ("MAP<STRING, STRING>", pa.map_(pa.string(), pa.string())),
    "body": ("BINARY", pa.binary()),
    "born_timestamp": ("TIMESTAMP", TS),
    "store_timestamp": ("TIMESTAMP", TS),
    "born_host": ("STRING", pa.string()),
    "store_host": ("STRING", pa.string()),
    "reconsume_times": ("INT", pa.int32()),
}
SCHEMA_DDL = ", ".join(f"{name} {ddl}" for name, (ddl, _t) in COLUMNS.items())
# Columns only a user schema asks for (not in the default schema, so exports keep their
# shape): what a query can use instead of a column it would otherwise have to copy.
EXTRA_COLUMNS: dict[str, tuple[str, pa.DataType]] = {
    "body_length": ("INT", pa.int32()),  # length(body) without copying any body
}
ALL_COLUMNS = {**COLUMNS, **EXTRA_COLUMNS}


class Fields:
    """Where each variable-length field of the selected records lies in the chunk."""

    def __init__(self, starts: np.ndarray, h: np.ndarray) -> None:
        self.topic = starts + HEADER_SIZE
        self.topic_len = h["topic_len"].astype(np.int64)
        self.tags = self.topic + self.topic_len
        self.tags_len = h["tags_len"].astype(np.int64)
        self.keys = self.tags + self.tags_len
        self.keys_len = h["keys_len"].astype(np.int64)
        self.props = self.keys + self.keys_len
        self.props_len = h["props_len"].astype(np.int64)
        self.body = self.props + self.props_len
        self.body_len = h["body_len"].astype(np.int64)


def cut(chunk: pa.Buffer, starts: np.ndarray, lengths: np.ndarray, type_: pa.DataType) -> pa.Array:
    """The byte ranges ``[starts, starts + lengths)`` of ``chunk`` (increasing, disjoint)."""
    n = len(starts)
    if n == 0:
        return pa.array([], type_)
    offs = np.empty(2 * n, dtype=np.int32)
    offs[0::2] = starts
    offs[1::2] = starts + lengths
    both = pa.Array.from_buffers(pa.binary(), 2 * n - 1, [None, pa.py_buffer(offs), chunk])
    picked = both.take(pa.array(np.arange(0, 2 * n - 1, 2, dtype=np.int32)))
    return picked if type_ == pa.binary() else picked.view(type_)


def _hosts(h: np.ndarray, ip: str, port: str) -> pa.Array:
    """``"ip:port"`` strings from the header fields, decoded once per distinct host."""
    n = len(h)
    raw = np.empty(n, dtype=[("ip", "V16"), ("port", "<u2")])
    raw["ip"], raw["port"] = h[ip], h[port]
    if (raw == raw[0]).all():  # the common case: one host for the whole batch
        return pa.array([_host_name(raw[0].tobytes())], pa.string()).take(pa.array(np.zeros(n, np.int32)))
    uniq, inverse = np.unique(raw, return_inverse=True)
    names = [_host_name(u.tobytes()) for u in uniq]
    return pa.array(names, pa.string()).take(pa.array(inverse.reshape(-1).astype(np.int32)))


def _host_name(raw: bytes) -> str:
    ip, port = decode_host(raw[:16], int.from_bytes(raw[16:18], "little"))
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _properties(chunk: memoryview, f: Fields) -> pa.Array:
    n = len(f.props)
    counts = np.zeros(n + 1, dtype=np.int32)
    keys: list[str] = []
    values: list[str] = []
    for i in np.flatnonzero(f.props_len).tolist():  # rare: one Python step per record with properties
        p, k = int(f.props[i]), int(f.props_len[i])
        props = decode_properties(chunk[p : p + k])
        keys += props.keys()
        values += props.values()
        counts[i + 1] = len(props)
    return pa.MapArray.from_arrays(
        pa.array(np.cumsum(counts, dtype=np.int32)), pa.array(keys, pa.string()), pa.array(values, pa.string())
    )


def _timestamps(ms: np.ndarray) -> pa.Array:
    us = ms.astype(np.int64) * 1000
    return pa.Array.from_buffers(TS, len(us), [None, pa.py_buffer(us)])


def build_batch(chunk: bytes, buf: np.ndarray, starts: np.ndarray, h: np.ndarray, schema: pa.Schema) -> pa.RecordBatch:
    """An Arrow batch of the records at ``starts`` (headers ``h``) with ``schema``'s columns."""
    f = Fields(starts, h)
    pbuf = pa.py_buffer(chunk)
    makers: dict[str, Callable[[], pa.Array]] = {
        "topic": lambda: cut(pbuf, f.topic, f.topic_len, pa.string()),
        "queue_id": lambda: pa.array(h["queue_id"].astype(np.int32)),
        "queue_offset": lambda: pa.array(h["queue_offset"].astype(np.int64)),
        "commitlog_offset": lambda: pa.array(h["commitlog_offset"].astype(np.int64)),
        "tags": lambda: cut(pbuf, f.tags, f.tags_len, pa.string()),
        "keys": lambda: cut(pbuf, f.keys, f.keys_len, pa.string()),
        "properties": lambda: _properties(memoryview(chunk), f),
        "body": lambda: cut(pbuf, f.body, f.body_len, pa.binary()),
        "born_timestamp": lambda: _timestamps(h["born_ts"]),
        "store_timestamp": lambda: _timestamps(h["store_ts"]),
        "born_host": lambda: _hosts(h, "born_host", "born_port"),
        "store_host": lambda: _hosts(h, "store_host", "store_port"),
        "reconsume_times": lambda: pa.array(h["reconsume_times"].astype(np.int32)),
        "body_length": lambda: pa.array(h["body_len"].astype(np.int32)),
    }
    arrays = [makers[name]() for name in schema.names]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def arrow_schema(names: list[str]) -> pa.Schema:
    """The Arrow schema Spark expects for these columns (all nullable, as Spark's are)."""
    unknown = [n for n in names if n not in ALL_COLUMNS]
    if unknown:
        raise ValueError(f"unknown column(s) {unknown}; clmq rows have: {', '.join(ALL_COLUMNS)}")
    return pa.schema([pa.field(n, ALL_COLUMNS[n][1], nullable=True) for n in names])
