// The load driver of `clmq bench peers` against Apache RocketMQ 5 (broker + name server),
// with RocketMQ's official remoting client (rocketmq-client) and its admin (rocketmq-tools).
//   PeersRocketMQ create NAMESRV BROKER TOPIC QUEUES
//   PeersRocketMQ produce NAMESRV TOPIC QUEUES MESSAGES SIZE WARMUP
//   PeersRocketMQ consume NAMESRV TOPIC EXPECTED GROUP
//   PeersRocketMQ latency NAMESRV TOPIC QUEUES RATE SECONDS SIZE
// produce/consume/latency warm up (produce: WARMUP messages first, so that the JVMs' JIT
// has compiled the hot paths; they are counted in "warmup"), print "ready", wait for a
// line on stdin (the benchmark reads the broker's CPU from then on), run, and print one
// line of JSON with their figures.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.lang.management.ManagementFactory;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.Comparator;
import java.util.List;
import java.util.Random;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.locks.LockSupport;

import org.apache.rocketmq.client.consumer.DefaultLitePullConsumer;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.SendCallback;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.SendStatus;
import org.apache.rocketmq.common.TopicConfig;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageExt;
import org.apache.rocketmq.common.message.MessageQueue;
import org.apache.rocketmq.tools.admin.DefaultMQAdminExt;

public final class PeersRocketMQ {
    static final long CONSUME_TIMEOUT_MS = 300_000;
    static final long ROUTE_TIMEOUT_MS = 120_000;
    static final int IN_FLIGHT_MAX_MESSAGES = 1024;
    // The client's own batching of async sends (5.x), as Kafka's linger.ms and clmq's linger_ms.
    static final boolean AUTO_BATCH = Boolean.parseBoolean(System.getProperty("peers.autoBatch", "true"));

    public static void main(String[] args) throws Exception {
        String namesrv = args[1];
        switch (args[0]) {
            case "create" -> create(namesrv, args[2], args[3], Integer.parseInt(args[4]));
            case "produce" -> produce(namesrv, args[2], Integer.parseInt(args[3]), Long.parseLong(args[4]),
                Integer.parseInt(args[5]), Integer.parseInt(args[6]));
            case "consume" -> consume(namesrv, args[2], Long.parseLong(args[3]), args[4]);
            case "latency" -> latency(namesrv, args[2], Integer.parseInt(args[3]), Integer.parseInt(args[4]),
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

    static void create(String namesrv, String broker, String topic, int queues) throws Exception {
        long t0 = System.nanoTime();
        DefaultMQAdminExt admin = new DefaultMQAdminExt();
        admin.setNamesrvAddr(namesrv);
        admin.setInstanceName("peers-admin-" + System.nanoTime());
        admin.start();
        try {
            TopicConfig config = new TopicConfig(topic, queues, queues);
            admin.createAndUpdateTopicConfig(broker, config);
        } finally {
            admin.shutdown();
        }
        DefaultMQProducer producer = producer(namesrv);
        try {
            route(producer, topic, queues);
        } finally {
            producer.shutdown();
        }
        System.out.println("{\"created_s\": " + (System.nanoTime() - t0) / 1e9 + "}");
    }

    static DefaultMQProducer producer(String namesrv) throws Exception {
        DefaultMQProducer producer = new DefaultMQProducer("peers-producer-" + System.nanoTime());
        producer.setNamesrvAddr(namesrv);
        producer.setInstanceName("peers-" + System.nanoTime());
        producer.setSendMsgTimeout(60_000);
        producer.setRetryTimesWhenSendAsyncFailed(0);
        producer.setAutoBatch(AUTO_BATCH);
        producer.start();
        return producer;
    }

    /** The topic's queues, sorted, once the name server routes all of them. */
    static List<MessageQueue> route(DefaultMQProducer producer, String topic, int queues) throws Exception {
        long deadline = System.currentTimeMillis() + ROUTE_TIMEOUT_MS;
        while (true) {
            try {
                List<MessageQueue> mqs = producer.fetchPublishMessageQueues(topic);
                if (mqs.size() == queues) {
                    mqs.sort(Comparator.comparingInt(MessageQueue::getQueueId));
                    return mqs;
                }
            } catch (Exception e) {
                if (System.currentTimeMillis() > deadline) throw e;
            }
            if (System.currentTimeMillis() > deadline) throw new IllegalStateException("no route to all queues");
            Thread.sleep(200);
        }
    }

    static void produce(String namesrv, String topic, int queues, long messages, int size, int warmup)
        throws Exception {
        byte[] body = new byte[size];
        new Random(7).nextBytes(body);
        AtomicLong failed = new AtomicLong();
        Semaphore window = new Semaphore(IN_FLIGHT_MAX_MESSAGES);
        DefaultMQProducer producer = producer(namesrv);
        try {
            List<MessageQueue> mqs = route(producer, topic, queues);
            producer.send(new Message(topic, body), mqs.get(0));  // connection and first request
            for (int i = 0; i < warmup; i++) {
                producer.send(new Message(topic, body), mqs.get(i % queues));
            }
            handshake();
            double c0 = cpuSeconds();
            long t0 = System.nanoTime();
            for (long i = 0; i < messages; i++) {
                window.acquire();
                producer.send(new Message(topic, body), mqs.get((int) (i % queues)), new SendCallback() {
                    public void onSuccess(SendResult r) {
                        if (r.getSendStatus() != SendStatus.SEND_OK) failed.incrementAndGet();
                        window.release();
                    }
                    public void onException(Throwable e) {
                        if (failed.incrementAndGet() == 1) System.err.println("first failure: " + e);
                        window.release();
                    }
                });
            }
            window.acquire(IN_FLIGHT_MAX_MESSAGES);
            double elapsed = (System.nanoTime() - t0) / 1e9;
            System.out.println("{\"sent\": " + messages + ", \"failed\": " + failed.get() + ", \"elapsed_s\": "
                + elapsed + ", \"client_cpu_s\": " + (cpuSeconds() - c0) + ", \"warmup\": " + (warmup + 1) + "}");
        } finally {
            producer.shutdown();
        }
    }

    static void consume(String namesrv, String topic, long expected, String group) throws Exception {
        DefaultLitePullConsumer consumer = new DefaultLitePullConsumer(group);
        consumer.setNamesrvAddr(namesrv);
        consumer.setInstanceName("peers-" + System.nanoTime());
        consumer.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        consumer.setPullBatchSize(256);
        consumer.setPullThreadNums(8);
        consumer.subscribe(topic, "*");
        handshake();
        double c0 = cpuSeconds();
        long t0 = System.nanoTime();
        consumer.start();
        try {
            long got = 0, first = 0;
            long deadline = System.currentTimeMillis() + CONSUME_TIMEOUT_MS;
            while (got < expected && System.currentTimeMillis() < deadline) {
                List<MessageExt> batch = consumer.poll(500);
                if (!batch.isEmpty()) {
                    got += batch.size();
                    if (first == 0) first = System.nanoTime();
                }
            }
            double elapsed = (System.nanoTime() - t0) / 1e9;
            System.out.println("{\"consumed\": " + got + ", \"expected\": " + expected + ", \"elapsed_s\": " + elapsed
                + ", \"first_s\": " + (first == 0 ? -1 : (first - t0) / 1e9) + ", \"client_cpu_s\": "
                + (cpuSeconds() - c0) + "}");
        } finally {
            consumer.shutdown();
        }
    }

    static void latency(String namesrv, String topic, int queues, int rate, double seconds, int size)
        throws Exception {
        byte[] body = new byte[size];
        new Random(7).nextBytes(body);
        int total = (int) (rate * seconds);
        long[] lat = new long[total];
        AtomicLong failed = new AtomicLong();
        Semaphore done = new Semaphore(0);
        DefaultMQProducer producer = producer(namesrv);
        try {
            List<MessageQueue> mqs = route(producer, topic, queues);
            producer.send(new Message(topic, body), mqs.get(0));
            handshake();
            double c0 = cpuSeconds();
            long start = System.nanoTime();
            for (int i = 0; i < total; i++) {
                long due = start + (long) (i * 1e9 / rate);
                long wait = due - System.nanoTime();
                if (wait > 0) LockSupport.parkNanos(wait);  // no spinning: 2 cores are shared with the broker
                final int k = i;
                final long t = System.nanoTime();
                producer.send(new Message(topic, body), mqs.get(i % queues), new SendCallback() {
                    public void onSuccess(SendResult r) {
                        lat[k] = System.nanoTime() - t;
                        done.release();
                    }
                    public void onException(Throwable e) {
                        if (failed.incrementAndGet() == 1) System.err.println("first failure: " + e);
                        done.release();
                    }
                });
            }
            done.tryAcquire(total, 120, TimeUnit.SECONDS);
            long[] ok = Arrays.stream(lat).filter(x -> x > 0).sorted().toArray();
            System.out.println("{\"sent\": " + total + ", \"answered\": " + ok.length + ", \"failed\": " + failed.get()
                + ", \"client_cpu_s\": " + (cpuSeconds() - c0) + ", \"p50_ms\": " + pct(ok, 0.5) + ", \"p99_ms\": "
                + pct(ok, 0.99) + ", \"p999_ms\": " + pct(ok, 0.999) + ", \"max_ms\": " + pct(ok, 1.0) + "}");
        } finally {
            producer.shutdown();
        }
    }

    static double pct(long[] sorted, double q) {
        if (sorted.length == 0) return Double.NaN;
        int i = Math.min(sorted.length - 1, Math.max(0, (int) Math.ceil(q * sorted.length) - 1));
        return sorted[i] / 1e6;
    }
}
