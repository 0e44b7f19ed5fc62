// The official Java Kafka client (kafka-clients) against clmq's Kafka listener, driven by
// tests/test_kafka_java.py. One command per run; records travel as tab-separated lines:
//   key \t value \t timestamp \t headers      (stdin of `produce`)
//   partition \t offset \t key \t value \t timestamp \t headers   (stdout of `produce`/`consume`)
// where key and value are base64 or "-" for null, headers are pairs joined by
// ",", name:value each side base64 (value "-" for null). Facts the tests check are printed as
// "fact \t name \t value" lines; the exit code is 0 unless the client reported an error.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Base64;
import java.util.Collection;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.Config;
import org.apache.kafka.clients.admin.ConfigEntry;
import org.apache.kafka.clients.admin.ConsumerGroupDescription;
import org.apache.kafka.clients.admin.DescribeClusterResult;
import org.apache.kafka.clients.admin.GroupListing;
import org.apache.kafka.clients.admin.ListGroupsOptions;
import org.apache.kafka.clients.admin.MemberDescription;
import org.apache.kafka.clients.admin.NewPartitions;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.consumer.AcknowledgeType;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.consumer.KafkaShareConsumer;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.Node;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.TopicCollection;
import org.apache.kafka.common.TopicIdPartition;
import org.apache.kafka.common.TopicPartitionInfo;
import org.apache.kafka.common.Uuid;
import org.apache.kafka.common.config.ConfigResource;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.header.internals.RecordHeader;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public final class KafkaHarness {
    private static final Base64.Encoder B64 = Base64.getEncoder();
    private static final Base64.Decoder UNB64 = Base64.getDecoder();
    private static final PrintStream OUT =
        new PrintStream(new java.io.FileOutputStream(java.io.FileDescriptor.out), false, StandardCharsets.UTF_8);

    public static void main(String[] args) throws Exception {
        int rc;
        try {
            switch (args[0]) {
                case "produce" -> rc = produce(args[1], args[2], args[3]);
                case "consume" -> rc = consume(args[1], args[2], args[3], Integer.parseInt(args[4]));
                case "seek" -> rc = seek(args[1], args[2], Long.parseLong(args[3]));
                case "admin" -> rc = admin(args[1], args[2], args[3]);
                case "transactional" -> rc = transactional(args[1], args[2]);
                case "share" -> rc = share(args[1], args[2], args[3], args[4], args[5]);
                default -> throw new IllegalArgumentException("unknown command " + args[0]);
            }
        } finally {
            OUT.flush();
        }
        System.exit(rc);
    }

    static void fact(String name, Object value) {
        OUT.println("fact\t" + name + "\t" + value);
    }

    static String b64(byte[] b) {
        return b == null ? "-" : B64.encodeToString(b);
    }

    static byte[] unb64(String s) {
        return s.equals("-") ? null : UNB64.decode(s);
    }

    static String row(int partition, long offset, byte[] key, byte[] value, long ts, Iterable<Header> headers) {
        StringBuilder h = new StringBuilder();
        for (Header header : headers) {
            if (h.length() > 0) h.append(',');
            h.append(b64(header.key().getBytes(StandardCharsets.UTF_8))).append(':').append(b64(header.value()));
        }
        return partition + "\t" + offset + "\t" + b64(key) + "\t" + b64(value) + "\t" + ts + "\t" + h;
    }

    /** The producer with its defaults (acks=all, idempotence on); records from stdin. */
    static int produce(String bootstrap, String topic, String compression) throws Exception {
        Properties p = new Properties();
        p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ProducerConfig.COMPRESSION_TYPE_CONFIG, compression);
        p.put(ProducerConfig.LINGER_MS_CONFIG, "5");
        List<ProducerRecord<byte[], byte[]>> records = new ArrayList<>();
        try (BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8))) {
            for (String line; (line = in.readLine()) != null; ) {
                String[] f = line.split("\t", -1);
                List<Header> headers = new ArrayList<>();
                if (!f[3].isEmpty()) {
                    for (String pair : f[3].split(",")) {
                        String[] kv = pair.split(":", 2);
                        headers.add(new RecordHeader(new String(unb64(kv[0]), StandardCharsets.UTF_8), unb64(kv[1])));
                    }
                }
                records.add(new ProducerRecord<>(topic, null, Long.parseLong(f[2]), unb64(f[0]), unb64(f[1]), headers));
            }
        }
        RecordMetadata[] acked = new RecordMetadata[records.size()];
        AtomicReference<Exception> failed = new AtomicReference<>();
        CountDownLatch done = new CountDownLatch(records.size());
        try (KafkaProducer<byte[], byte[]> producer =
                 new KafkaProducer<>(secured(p), new ByteArraySerializer(), new ByteArraySerializer())) {
            for (int i = 0; i < records.size(); i++) {
                final int index = i;
                producer.send(records.get(i), (md, err) -> {
                    if (err != null) failed.compareAndSet(null, err);
                    else acked[index] = md;
                    done.countDown();
                });
            }
            producer.flush();
            if (!done.await(60, TimeUnit.SECONDS)) throw new IllegalStateException("sends not acknowledged in 60 s");
        }
        if (failed.get() != null) {
            fact("error", failed.get());
            return 1;
        }
        for (int i = 0; i < records.size(); i++) {
            ProducerRecord<byte[], byte[]> r = records.get(i);
            OUT.println(row(acked[i].partition(), acked[i].offset(), r.key(), r.value(), acked[i].timestamp(), r.headers()));
        }
        return 0;
    }

    /** The client's security settings (security.protocol, sasl.*, ssl.*) from the
     *  properties file $HARNESS_CLIENT_PROPERTIES names, if any, over {@code p}. */
    static Properties secured(Properties p) {
        String path = System.getenv("HARNESS_CLIENT_PROPERTIES");
        if (path == null || path.isEmpty()) return p;
        try (java.io.Reader in = java.nio.file.Files.newBufferedReader(java.nio.file.Path.of(path))) {
            p.load(in);
        } catch (java.io.IOException e) {
            throw new java.io.UncheckedIOException(e);
        }
        return p;
    }

    static Properties consumerProps(String bootstrap, String group) {
        Properties p = new Properties();
        p.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ConsumerConfig.GROUP_ID_CONFIG, group);
        p.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        p.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        p.put(ConsumerConfig.SESSION_TIMEOUT_MS_CONFIG, "10000");
        p.put(ConsumerConfig.HEARTBEAT_INTERVAL_MS_CONFIG, "1000");
        return p;
    }

    /** A consumer in a group reads `count` records, commits them, and prints them. */
    static int consume(String bootstrap, String topic, String group, int count) throws Exception {
        List<String> rows = new ArrayList<>();
        try (KafkaConsumer<byte[], byte[]> consumer =
                 new KafkaConsumer<>(secured(consumerProps(bootstrap, group)), new ByteArrayDeserializer(), new ByteArrayDeserializer())) {
            consumer.subscribe(List.of(topic));
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(40);
            while (rows.size() < count && System.nanoTime() < deadline) {
                ConsumerRecords<byte[], byte[]> got = consumer.poll(Duration.ofMillis(500));
                for (ConsumerRecord<byte[], byte[]> r : got) {
                    rows.add(row(r.partition(), r.offset(), r.key(), r.value(), r.timestamp(), r.headers()));
                }
            }
            consumer.commitSync(Duration.ofSeconds(15));
            Set<TopicPartition> assigned = consumer.assignment();
            Map<TopicPartition, OffsetAndMetadata> committed = consumer.committed(assigned, Duration.ofSeconds(15));
            TreeMap<Integer, Object> commits = new TreeMap<>();
            TreeMap<Integer, Long> positions = new TreeMap<>();
            committed.forEach((tp, om) -> commits.put(tp.partition(), om == null ? "none" : om.offset()));
            for (TopicPartition tp : assigned) positions.put(tp.partition(), consumer.position(tp));
            fact("committed", commits);
            fact("positions", positions);
        }
        for (String r : rows) OUT.println(r);
        return rows.size() == count ? 0 : 2;
    }

    /** Without a group: each partition's bounds, the offset for a timestamp, and the record there. */
    static int seek(String bootstrap, String topic, long timestamp) {
        Properties p = new Properties();
        p.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        try (KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(secured(p), new ByteArrayDeserializer(), new ByteArrayDeserializer())) {
            List<TopicPartition> parts = new ArrayList<>();
            consumer.partitionsFor(topic, Duration.ofSeconds(15)).forEach(i -> parts.add(new TopicPartition(topic, i.partition())));
            parts.sort((a, b) -> Integer.compare(a.partition(), b.partition()));
            Duration wait = Duration.ofSeconds(15);
            Map<TopicPartition, Long> begin = consumer.beginningOffsets(parts, wait);
            Map<TopicPartition, Long> end = consumer.endOffsets(parts, wait);
            Map<TopicPartition, Long> at = new HashMap<>();
            parts.forEach(tp -> at.put(tp, timestamp));
            var found = consumer.offsetsForTimes(at, wait);
            consumer.assign(parts);
            for (TopicPartition tp : parts) {
                var o = found.get(tp);
                fact("bounds " + tp.partition(), begin.get(tp) + " " + end.get(tp));
                fact("for.time " + tp.partition(), o == null ? "none" : o.offset() + " " + o.timestamp());
                if (o != null) consumer.seek(tp, o.offset());
                else consumer.pause(List.of(tp));
            }
            Map<Integer, String> first = new TreeMap<>();
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
            while (first.size() < parts.size() - consumer.paused().size() && System.nanoTime() < deadline) {
                for (ConsumerRecord<byte[], byte[]> r : consumer.poll(Duration.ofMillis(500))) {
                    first.putIfAbsent(r.partition(), row(r.partition(), r.offset(), r.key(), r.value(), r.timestamp(), r.headers()));
                }
            }
            first.values().forEach(OUT::println);
        }
        return 0;
    }

    /** The AdminClient's topic and group calls, each result printed as a fact. */
    static int admin(String bootstrap, String topic, String group) throws Exception {
        Properties p = new Properties();
        p.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "30000");
        p.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "15000");
        try (Admin admin = Admin.create(secured(p))) {
            DescribeClusterResult cluster = admin.describeCluster();
            Collection<Node> nodes = cluster.nodes().get();
            fact("cluster.id", cluster.clusterId().get());
            fact("cluster.controller", cluster.controller().get().id());
            for (Node n : nodes) fact("cluster.node", n.id() + " " + n.host() + ":" + n.port());

            admin.createTopics(List.of(new NewTopic(topic, 2, (short) 1))).all().get();
            fact("created", topic);
            fact("listed", admin.listTopics().names().get().contains(topic));
            describeTopic(admin, topic, "before");

            ConfigResource res = new ConfigResource(ConfigResource.Type.TOPIC, topic);
            Config config = admin.describeConfigs(List.of(res)).all().get().get(res);
            for (ConfigEntry e : new TreeMap<>(entries(config)).values()) {
                fact("config " + e.name(), e.value());
            }

            ConfigResource broker = new ConfigResource(ConfigResource.Type.BROKER, String.valueOf(nodes.iterator().next().id()));
            try {
                Config brokerConfig = admin.describeConfigs(List.of(broker)).all().get().get(broker);
                fact("broker.configs", brokerConfig.entries().size());
            } catch (ExecutionException e) {
                fact("broker.configs", e.getCause().getClass().getSimpleName() + ": " + e.getCause().getMessage());
            }
            Uuid id = admin.describeTopics(List.of(topic)).allTopicNames().get().get(topic).topicId();
            TopicDescription byId = admin.describeTopics(TopicCollection.ofTopicIds(List.of(id))).allTopicIds().get().get(id);
            fact("describe.by.id", byId.name() + " " + byId.partitions().size());

            admin.createPartitions(Map.of(topic, NewPartitions.increaseTo(5))).all().get();
            describeTopic(admin, topic, "after");
            try {
                admin.createPartitions(Map.of(topic, NewPartitions.increaseTo(3))).all().get();
                fact("shrink", "accepted");
            } catch (ExecutionException e) {
                fact("shrink", e.getCause().getClass().getSimpleName());
            }

            // A group with committed offsets: a consumer reads what a producer wrote, commits, leaves.
            Properties pp = new Properties();
            pp.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
            try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(secured(pp), new ByteArraySerializer(), new ByteArraySerializer())) {
                for (int i = 0; i < 10; i++) {
                    producer.send(new ProducerRecord<>(topic, i % 5, null, ("v" + i).getBytes(StandardCharsets.UTF_8))).get();
                }
            }
            int read = 0;
            try (KafkaConsumer<byte[], byte[]> consumer =
                     new KafkaConsumer<>(secured(consumerProps(bootstrap, group)), new ByteArrayDeserializer(), new ByteArrayDeserializer())) {
                consumer.subscribe(List.of(topic));
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
                while (read < 10 && System.nanoTime() < deadline) {
                    read += consumer.poll(Duration.ofMillis(500)).count();
                }
                consumer.commitSync();
                // While the member is in the group: its description.
                ConsumerGroupDescription live = admin.describeConsumerGroups(List.of(group)).all().get().get(group);
                fact("group.live.state", live.groupState());
                fact("group.live.members", live.members().size());
                for (MemberDescription m : live.members()) {
                    TreeSet<Integer> parts = new TreeSet<>();
                    m.assignment().topicPartitions().forEach(tp -> parts.add(tp.partition()));
                    fact("group.live.assignment", parts);
                }
                fact("group.live.coordinator", live.coordinator().id());
            }
            fact("group.read", read);

            TreeSet<String> listed = new TreeSet<>();
            for (GroupListing l : admin.listGroups(ListGroupsOptions.forConsumerGroups()).all().get()) listed.add(l.groupId());
            fact("groups.listed", listed.contains(group));
            ConsumerGroupDescription desc = admin.describeConsumerGroups(List.of(group)).all().get().get(group);
            fact("group.state", desc.groupState());
            fact("group.members", desc.members().size());
            TreeMap<Integer, Long> offsets = new TreeMap<>();
            admin.listConsumerGroupOffsets(group).partitionsToOffsetAndMetadata().get()
                .forEach((tp, om) -> offsets.put(tp.partition(), om.offset()));
            fact("group.offsets", offsets);

            admin.deleteConsumerGroups(List.of(group)).all().get();
            TreeSet<String> after = new TreeSet<>();
            for (GroupListing l : admin.listGroups(ListGroupsOptions.forConsumerGroups()).all().get()) after.add(l.groupId());
            fact("groups.listed.after.delete", after.contains(group));
            try {
                admin.deleteConsumerGroups(List.of(group)).all().get();
                fact("group.delete.again", "accepted");
            } catch (ExecutionException e) {
                fact("group.delete.again", e.getCause().getClass().getSimpleName());
            }

            admin.deleteTopics(List.of(topic)).all().get();
            fact("listed.after.delete", admin.listTopics().names().get().contains(topic));
            try {
                admin.describeTopics(List.of(topic)).allTopicNames().get();
                fact("describe.after.delete", "found");
            } catch (ExecutionException e) {
                fact("describe.after.delete", e.getCause().getClass().getSimpleName());
            }
        }
        return 0;
    }

    static Map<String, ConfigEntry> entries(Config config) {
        Map<String, ConfigEntry> m = new HashMap<>();
        for (ConfigEntry e : config.entries()) m.put(e.name(), e);
        return m;
    }

    static void describeTopic(Admin admin, String topic, String when) throws Exception {
        TopicDescription d = admin.describeTopics(List.of(topic)).allTopicNames().get().get(topic);
        fact("describe." + when + ".name", d.name());
        fact("describe." + when + ".internal", d.isInternal());
        fact("describe." + when + ".id", d.topicId());
        fact("describe." + when + ".partitions", d.partitions().size());
        TreeSet<String> leaders = new TreeSet<>();
        for (TopicPartitionInfo info : d.partitions()) {
            leaders.add(info.partition() + ":" + info.leader().id() + ":" + info.replicas().size() + ":" + info.isr().size());
        }
        fact("describe." + when + ".leaders", leaders);
    }

    /** A transactional producer: the error the client reports, with its causes. */
    static int transactional(String bootstrap, String topic) {
        Properties p = new Properties();
        p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ProducerConfig.TRANSACTIONAL_ID_CONFIG, "clmq-java-txn");
        p.put(ProducerConfig.MAX_BLOCK_MS_CONFIG, "20000");
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(secured(p), new ByteArraySerializer(), new ByteArraySerializer())) {
            producer.initTransactions();
            producer.beginTransaction();
            producer.send(new ProducerRecord<>(topic, "x".getBytes(StandardCharsets.UTF_8))).get();
            producer.commitTransaction();
            fact("transaction", "committed");
            return 0;
        } catch (Exception e) {
            for (Throwable t = e; t != null; t = t.getCause()) {
                fact("error", t.getClass().getName() + ": " + t.getMessage());
            }
            return 1;
        }
    }

    /**
     * A share consumer (KIP-932) of one topic, explicit acknowledgement, until the file
     * stopFile exists (then closed). Each record is printed as
     * "got \t partition \t offset \t deliveryCount \t value(UTF-8) \t action" before its
     * acknowledgement; policy chooses the action: accept, reject, release-once (RELEASE
     * on a first delivery, ACCEPT later) or hold (nothing acknowledged, no further poll).
     * Acknowledgements are committed after each poll; a failed one prints
     * "ackerror \t partition \t exception".
     */
    static int share(String bootstrap, String topic, String group, String policy, String stopFile) throws Exception {
        Properties p = new Properties();
        p.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ConsumerConfig.GROUP_ID_CONFIG, group);
        p.put(ConsumerConfig.MAX_POLL_RECORDS_CONFIG, "20");
        p.put("share.acknowledgement.mode", "explicit");
        java.nio.file.Path stop = java.nio.file.Path.of(stopFile);
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(120);
        boolean holding = false;
        try (KafkaShareConsumer<byte[], byte[]> consumer =
                 new KafkaShareConsumer<>(secured(p), new ByteArrayDeserializer(), new ByteArrayDeserializer())) {
            consumer.subscribe(List.of(topic));
            fact("subscribed", topic);
            OUT.flush();
            while (!java.nio.file.Files.exists(stop) && System.nanoTime() < deadline) {
                if (holding) {
                    Thread.sleep(50);  // waits for the stop file (or a kill) with its records held
                    continue;
                }
                ConsumerRecords<byte[], byte[]> records = consumer.poll(Duration.ofMillis(200));
                List<String> settled = new ArrayList<>();
                for (ConsumerRecord<byte[], byte[]> r : records) {
                    int count = r.deliveryCount().orElse((short) -1);
                    String action = switch (policy) {
                        case "accept" -> "ACCEPT";
                        case "reject" -> "REJECT";
                        case "release-once" -> count <= 1 ? "RELEASE" : "ACCEPT";
                        case "hold" -> "HOLD";
                        default -> throw new IllegalArgumentException("unknown policy " + policy);
                    };
                    String value = r.value() == null ? "-" : new String(r.value(), StandardCharsets.UTF_8);
                    OUT.println("got\t" + r.partition() + "\t" + r.offset() + "\t" + count + "\t" + value + "\t" + action);
                    if (!action.equals("HOLD")) {
                        consumer.acknowledge(r, AcknowledgeType.valueOf(action));
                        settled.add(r.partition() + "\t" + r.offset() + "\t" + value);
                    }
                }
                if (!records.isEmpty() && policy.equals("hold")) {
                    holding = true;
                } else if (!records.isEmpty()) {
                    commit(consumer, settled);
                }
                OUT.flush();
            }
            fact("closing", policy);
            OUT.flush();
        }
        return 0;
    }

    /** Commits the acknowledgements of one poll: "done \t partition \t offset \t value" for
     * each record whose partition's acknowledgement the broker confirmed, "ackerror" lines else. */
    static void commit(KafkaShareConsumer<byte[], byte[]> consumer, List<String> settled) {
        Set<Integer> confirmed = new TreeSet<>();
        try {
            Map<TopicIdPartition, java.util.Optional<org.apache.kafka.common.KafkaException>> done =
                consumer.commitSync(Duration.ofSeconds(10));
            for (var e : done.entrySet()) {
                if (e.getValue().isPresent()) {
                    OUT.println("ackerror\t" + e.getKey().partition() + "\t" + e.getValue().get());
                } else {
                    confirmed.add(e.getKey().partition());
                }
            }
        } catch (org.apache.kafka.common.KafkaException e) {
            OUT.println("ackerror\t-1\t" + e);
            return;
        }
        for (String s : settled) {
            if (confirmed.contains(Integer.parseInt(s.split("\t", 2)[0]))) {
                OUT.println("done\t" + s);
            }
        }
    }
}
