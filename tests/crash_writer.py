"""Run as a subprocess by test_crash.py: append forever with synchronous flush from
several threads, printing ``ACK <body> ...`` only after a batch is reported durable."""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clmq.broker.store import Store
from clmq.commitlog import FlushMode
from clmq.common import Message
from tests.conftest import small_config

QUEUES = 8


def config(data_dir: str, mode: str = "commitlog"):  # type: ignore[no-untyped-def]
    return small_config(
        Path(data_dir),
        segment_bytes=64 * 1024,
        max_message_bytes=4096,
        mode=mode,
        log={"flush_mode": FlushMode.SYNC},
        cq_entries_per_file=64,
        cq_flush_interval_ms=50,
    )


def main(data_dir: str, tag: str, mode: str) -> None:
    store = Store.open(config(data_dir, mode)).start()
    if store.topics.queue_count("c") is None:
        store.create_topic("c", QUEUES)
    out_lock = threading.Lock()
    print("READY", flush=True)

    def writer(w: int) -> None:
        rng = random.Random(f"{tag}-{w}")
        n = 0
        while True:
            bodies = [f"{tag}-{w}-{n + i}".encode() for i in range(rng.randint(1, 20))]
            n += len(bodies)
            res = store.put_batch([Message("c", rng.randrange(QUEUES), b) for b in bodies])
            if res.ok:  # sync flush: OK means fsynced
                with out_lock:
                    sys.stdout.write("ACK " + " ".join(b.decode() for b in bodies) + "\n")
                    sys.stdout.flush()

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
