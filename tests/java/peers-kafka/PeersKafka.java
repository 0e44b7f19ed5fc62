// The load driver of `clmq bench peers` on the Kafka protocol: Apache Kafka's official Java
// client (kafka-clients) against Apache Kafka itself and against clmq's Kafka listener.
//   PeersKafka create BOOTSTRAP TOPIC PARTITIONS
//   PeersKafka produce BOOTSTRAP TOPIC PARTITIONS MESSAGES SIZE WARMUP
//   PeersKafka consume BOOTSTRAP TOPIC EXPECTED GROUP
//   PeersKafka latency BOOTSTRAP TOPIC PARTITIONS RATE SECONDS SIZE
// produce/consume/latency warm up (produce: WARMUP messages first, so that the JVMs' JIT
// has compiled the hot paths; they are counted in "warmup"), print "ready", wait for a
// line on stdin (the benchmark reads the broker's CPU from then on), run, and print one
// line of JSON with their figures.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.lang.management.ManagementFactory;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Random;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.locks.LockSupport;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.NewPartitions;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.errors.TopicExistsException;
import org.apache.kafka.common.errors.UnknownTopicOrPartitionException;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public final class PeersKafka {
    static final long CONSUME_TIMEOUT_MS = 300_000;
    static final long CREATE_TIMEOUT_MS = 600_000;
    // KRaft: at most 10,000 records per operation; a test sets a small step to cover growing.
    static final int PARTITIONS_PER_OP =
        Integer.parseInt(System.getenv().getOrDefault("CLMQ_PEERS_KAFKA_PARTITIONS_PER_OP", "5000"));

    public static void main(String[] args) throws Exception {
        String bootstrap = args[1];
        String topic = args[2];
        switch (args[0]) {
            case "create" -> create(bootstrap, topic, Integer.parseInt(args[3]));
            case "produce" -> produce(bootstrap, topic, Integer.parseInt(args[3]), Long.parseLong(args[4]),
                Integer.parseInt(args[5]), Integer.parseInt(args[6]));
            case "consume" -> consume(bootstrap, topic, Long.parseLong(args[3]), args[4]);
            case "latency" -> latency(bootstrap, topic, Integer.parseInt(args[3]), Integer.parseInt(args[4]),
                Double.parseDouble(args[5]), Integer.parseInt(args[6]));
            default -> throw new IllegalArgumentException("unknown command " + args[0]);
        }
        System.out.flush();
        System.exit(0);
    }

    static double cpuSeconds() {
        com.sun.management.OperatingSystemMXBean os =
            (com.sun.management.OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean();
        return os.getProcessCpuTime() / 1e9;
    }

    static void handshake() throws Exception {
        System.out.println("ready");
        System.out.flush();
        new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8)).readLine();
    }

    static void create(String bootstrap, String topic, int partitions) throws Exception {
        Properties p = new Properties();
        p.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, (int) CREATE_TIMEOUT_MS);
        p.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, (int) CREATE_TIMEOUT_MS);
        long t0 = System.nanoTime();
        try (Admin admin = Admin.create(p)) {
            // KRaft's controller refuses one operation of more than 10,000 records
            // ("excessively large batch operation"): a partition is a record, so the
            // topic grows in steps.
            int first = Math.min(partitions, PARTITIONS_PER_OP);
            try {
                admin.createTopics(List.of(new NewTopic(topic, first, (short) 1))).all()
                    .get(CREATE_TIMEOUT_MS, TimeUnit.MILLISECONDS);
            } catch (ExecutionException e) {
                if (!(e.getCause() instanceof TopicExistsException)) throw e;
            }
            for (int have = first; have < partitions; have += PARTITIONS_PER_OP) {
                int to = Math.min(partitions, have + PARTITIONS_PER_OP);
                admin.createPartitions(Map.of(topic, NewPartitions.increaseTo(to))).all()
                    .get(CREATE_TIMEOUT_MS, TimeUnit.MILLISECONDS);
            }
            long deadline = System.currentTimeMillis() + CREATE_TIMEOUT_MS;
            while (true) {  // until every partition has its leader
                try {
                    var d = admin.describeTopics(List.of(topic)).allTopicNames().get().get(topic);
                    if (d.partitions().size() == partitions && d.partitions().stream().allMatch(x -> x.leader() != null)) {
                        break;
                    }
                } catch (ExecutionException e) {  // not known yet to the broker that answered
                    if (!(e.getCause() instanceof UnknownTopicOrPartitionException)) throw e;
                }
                if (System.currentTimeMillis() > deadline) throw new IllegalStateException("partitions not led in time");
                Thread.sleep(100);
            }
        }
        System.out.println("{\"created_s\": " + (System.nanoTime() - t0) / 1e9 + "}");
    }

    static KafkaProducer<byte[], byte[]> producer(String bootstrap) {
        Properties p = new Properties();
        p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ProducerConfig.ACKS_CONFIG, "all");
        p.put(ProducerConfig.LINGER_MS_CONFIG, "5");
        p.put(ProducerConfig.BATCH_SIZE_CONFIG, "65536");  // per partition: 1 MiB x 1,000 would not fit buffer.memory
        p.put(ProducerConfig.BUFFER_MEMORY_CONFIG, String.valueOf(256L << 20));
        p.put(ProducerConfig.COMPRESSION_TYPE_CONFIG, "none");
        // Not idempotent, as clmq's producer and `clmq bench kafka`'s librdkafka: with it, 1,000
        // partitions on a loaded machine ran into OutOfOrderSequence retries for minutes.
        p.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "false");
        p.put(ProducerConfig.DELIVERY_TIMEOUT_MS_CONFIG, "600000");
        p.put(ProducerConfig.REQUEST_TIMEOUT_MS_CONFIG, "300000");
        p.put(ProducerConfig.MAX_REQUEST_SIZE_CONFIG, String.valueOf(8 << 20));
        return new KafkaProducer<>(p, new ByteArraySerializer(), new ByteArraySerializer());
    }

    static void produce(String bootstrap, String topic, int partitions, long messages, int size, int warmup)
        throws Exception {
        byte[] body = new byte[size];
        new Random(7).nextBytes(body);
        AtomicLong failed = new AtomicLong();
        try (KafkaProducer<byte[], byte[]> producer = producer(bootstrap)) {
            producer.send(new ProducerRecord<>(topic, 0, null, body)).get();  // metadata and connection
            for (int i = 0; i < warmup; i++) {
                producer.send(new ProducerRecord<>(topic, i % partitions, null, body));
            }
            producer.flush();
            handshake();
            double c0 = cpuSeconds();
            long t0 = System.nanoTime();
            for (long i = 0; i < messages; i++) {
                producer.send(new ProducerRecord<>(topic, (int) (i % partitions), null, body), (md, e) -> {
                    if (e != null) failed.incrementAndGet();
                });
            }
            producer.flush();
            double elapsed = (System.nanoTime() - t0) / 1e9;
            System.out.println("{\"sent\": " + messages + ", \"failed\": " + failed.get() + ", \"elapsed_s\": "
                + elapsed + ", \"client_cpu_s\": " + (cpuSeconds() - c0) + ", \"warmup\": " + (warmup + 1) + "}");
        }
    }

    static void consume(String bootstrap, String topic, long expected, String group) throws Exception {
        Properties p = new Properties();
        p.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ConsumerConfig.GROUP_ID_CONFIG, group);
        p.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        p.put(ConsumerConfig.MAX_POLL_RECORDS_CONFIG, "10000");
        p.put(ConsumerConfig.MAX_PARTITION_FETCH_BYTES_CONFIG, String.valueOf(1 << 20));
        p.put(ConsumerConfig.FETCH_MAX_BYTES_CONFIG, String.valueOf(50 << 20));
        try (KafkaConsumer<byte[], byte[]> consumer =
                 new KafkaConsumer<>(p, new ByteArrayDeserializer(), new ByteArrayDeserializer())) {
            handshake();
            double c0 = cpuSeconds();
            long t0 = System.nanoTime();
            consumer.subscribe(Collections.singletonList(topic));
            long got = 0, first = 0, last = 0;
            long deadline = System.currentTimeMillis() + CONSUME_TIMEOUT_MS;
            while (got < expected && System.currentTimeMillis() < deadline) {
                ConsumerRecords<byte[], byte[]> records = consumer.poll(Duration.ofMillis(500));
                if (records.count() > 0) {
                    got += records.count();
                    last = System.nanoTime();
                    if (first == 0) first = last;
                }
            }
            double elapsed = (System.nanoTime() - t0) / 1e9;
            System.out.println("{\"consumed\": " + got + ", \"expected\": " + expected + ", \"elapsed_s\": " + elapsed
                + ", \"first_s\": " + (first == 0 ? -1 : (first - t0) / 1e9) + ", \"client_cpu_s\": "
                + (cpuSeconds() - c0) + "}");
        }
    }

    static void latency(String bootstrap, String topic, int partitions, int rate, double seconds, int size)
        throws Exception {
        byte[] body = new byte[size];
        new Random(7).nextBytes(body);
        int total = (int) (rate * seconds);
        long[] lat = new long[total];
        AtomicLong failed = new AtomicLong();
        AtomicLong answered = new AtomicLong();
        try (KafkaProducer<byte[], byte[]> producer = producer(bootstrap)) {
            producer.send(new ProducerRecord<>(topic, 0, null, body)).get();
            handshake();
            double c0 = cpuSeconds();
            long start = System.nanoTime();
            for (int i = 0; i < total; i++) {
                long due = start + (long) (i * 1e9 / rate);
                long wait = due - System.nanoTime();
                if (wait > 0) LockSupport.parkNanos(wait);  // no spinning: 2 cores are shared with the broker
                final int k = i;
                final long t = System.nanoTime();
                producer.send(new ProducerRecord<>(topic, i % partitions, null, body), (md, e) -> {
                    if (e != null) { failed.incrementAndGet(); lat[k] = -1; }
                    else { lat[k] = System.nanoTime() - t; answered.incrementAndGet(); }
                });
            }
            producer.flush();
            printLatency(lat, total, failed.get(), cpuSeconds() - c0);
        }
    }

    static void printLatency(long[] lat, int total, long failed, double cpu) {
        long[] ok = Arrays.stream(lat).filter(x -> x > 0).sorted().toArray();
        System.out.println("{\"sent\": " + total + ", \"answered\": " + ok.length + ", \"failed\": " + failed
            + ", \"client_cpu_s\": " + cpu + ", \"p50_ms\": " + pct(ok, 0.5) + ", \"p99_ms\": " + pct(ok, 0.99)
            + ", \"p999_ms\": " + pct(ok, 0.999) + ", \"max_ms\": " + pct(ok, 1.0) + "}");
    }

    static double pct(long[] sorted, double q) {
        if (sorted.length == 0) return Double.NaN;
        int i = Math.min(sorted.length - 1, Math.max(0, (int) Math.ceil(q * sorted.length) - 1));
        return sorted[i] / 1e6;
    }
}
