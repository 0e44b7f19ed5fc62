"""clmq's CommitLog: one sequential, segmented log holding every message of every queue.

Plain, synchronous, typed storage code (no trio, msgpack, kazoo or pyspark). The
public surface is re-exported here; the modules behind it are private.
"""

from ._config import CommitLogConfig, FlushMode, GiB, MiB
from ._errors import (
    ClientError, ClmqError, ConfigError, ConnectorError, CorruptRecordError, InvalidInputError, ProtocolError,
    ServiceError, StoreError, TransportError,
)  # fmt: skip
from ._log import AppendResult, AppendStatus, CommitLog, QueueKey, ScanResult, now_ms
from ._record import (
    BLANK_MAGIC, BLANK_SIZE, FORMAT_VERSION, HEADER, HEADER_SIZE, OFF_BODY_LEN, OFF_BORN_HOST,
    OFF_BORN_PORT, OFF_BORN_TS, OFF_COMMITLOG_OFFSET, OFF_CRC, OFF_FLAGS, OFF_KEYS_LEN, OFF_MAGIC,
    OFF_PROPS_LEN, OFF_QUEUE_ID, OFF_QUEUE_OFFSET, OFF_RECONSUME, OFF_STORE_HOST, OFF_STORE_PORT,
    OFF_STORE_TS, OFF_TAGS_LEN, OFF_TOPIC_LEN, OFF_TOTAL_SIZE, RECORD_MAGIC, CRC_START, Host, Message, Record,
    check_record, decode_host, decode_properties, decode_record, encode_properties,
)  # fmt: skip
from ._columns import HEADER_DTYPE, Walk, gather_fields, gather_headers, gather_strings, walk_records
from ._durability import DurableOffset
from ._encoder import BatchEncoder, EncodeError, encode_message
from ._packed import ITEM_SIZE, PackedMessages, PackError, pack_messages, set_queue_id, unpack_messages
from ._segment import fsync_dir
from ._many import decode_records_many

__all__ = [
    "BatchEncoder", "CRC_START", "ClientError", "ClmqError", "ConnectorError", "EncodeError", "InvalidInputError",
    "ProtocolError", "ScanResult", "ServiceError", "TransportError", "check_record",
    "AppendResult", "AppendStatus", "DurableOffset", "BLANK_MAGIC", "BLANK_SIZE", "CommitLog", "CommitLogConfig",
    "ConfigError", "CorruptRecordError", "FORMAT_VERSION", "FlushMode", "GiB", "HEADER",
    "HEADER_SIZE", "Host", "OFF_BODY_LEN", "OFF_BORN_HOST", "OFF_BORN_PORT", "OFF_BORN_TS",
    "OFF_COMMITLOG_OFFSET", "OFF_CRC", "OFF_FLAGS", "OFF_KEYS_LEN", "OFF_MAGIC", "OFF_PROPS_LEN",
    "OFF_QUEUE_ID", "OFF_QUEUE_OFFSET", "OFF_RECONSUME", "OFF_STORE_HOST", "OFF_STORE_PORT",
    "OFF_STORE_TS", "OFF_TAGS_LEN", "OFF_TOPIC_LEN", "OFF_TOTAL_SIZE", "decode_host", "decode_properties", "encode_properties", "Message", "MiB", "QueueKey", "RECORD_MAGIC", "Record", "StoreError",
    "decode_record", "encode_message", "HEADER_DTYPE", "Walk", "gather_fields", "gather_headers", "gather_strings", "walk_records", "fsync_dir", "now_ms", "decode_records_many",
    "ITEM_SIZE", "PackedMessages", "PackError", "pack_messages", "set_queue_id", "unpack_messages",
]  # fmt: skip
