"""The Kafka listener (docs/kafka.md): Kafka's own clients (the Java client,
librdkafka and kcat, kafka-python, aiokafka, ...) produce, consume, run consumer
groups and administer topics on a clmq broker, over the same store as clmq's own
protocol. The codec is :mod:`clmq.protocol.kafka` (sans-IO); this family is the trio
side: the listener, the handlers, the group coordinator."""

from ._cluster import node_id_of
from ._metrics import KafkaCollector
from ._service import KafkaService

__all__ = ["KafkaCollector", "KafkaService", "node_id_of"]
