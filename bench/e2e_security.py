"""``clmq bench e2e --tls`` and ``--auth`` (issue 31): the same cases through TLS and
with logins and ACL checks on, against plaintext in the same run.

Every case runs once per *mode*, the modes one after the other (their order reversed
every other run, so that drift affects them alike), each on a fresh broker process:

- ``plain``: as ``clmq bench e2e`` without the flags (zero-copy sendfile for readers);
- ``tls``: the broker's listener speaks only TLS (a throw-away CA and a certificate for
  127.0.0.1 made in the run's temporary directory, devtools/certs.py); the clients
  verify it. Replies are read into memory and encrypted: no sendfile;
- ``auth``: ``auth_enabled``; the bench's producer and consumer log in (SCRAM-SHA-256)
  as a user that is *not* a super user, so that every request is decided by its ACLs:
  WRITE and READ on the topic, READ on the consumer's retry topic and on its group,
  DESCRIBE on the cluster (BROKER_INFO: the clients are given the broker's address),
  seeded into the data directory's ``security.json`` before the broker starts (the
  admin that creates the topic is a super user);
- ``tls+auth``: both (with both flags).

The figures are each mode's msgs/s and its ratio to plaintext: the median over the
runs of the ratio within each run (a mode's sample over the plaintext sample of the
same case and run, measured minutes apart at most), against the issue's aims.
"""

from __future__ import annotations

import secrets
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clmq.protocol.auth import (
    CLUSTER_NAME,
    SECURITY_FILE,
    AclBinding,
    Operation,
    PatternType,
    Permission,
    ResourceType,
    SecurityState,
    make_credential,
    save_security,
)
from clmq.protocol.transport import ClientSecurity, TlsSettings

PLAIN, TLS, AUTH, TLS_AUTH = "plain", "tls", "auth", "tls+auth"
MODES = (PLAIN, TLS, AUTH, TLS_AUTH)
BENCH_USER = "bench"  # the producer and the consumer: ACLs decide each of its requests
ADMIN_USER = "bench-admin"  # creates the topics: a super user
MECHANISM = "SCRAM-SHA-256"
GROUP = "bench"  # the consumer group of e2e_load.consume

# The aims: ratios to plaintext, measured in the same run.
AIM_AUTH_RATIO = 0.95  # authentication and ACL checks cost at most 5% of throughput
AIM_TLS_PRODUCE_RATIO = 0.7
AIM_TLS_CONSUME_RATIO = 0.5  # a TLS reader has no sendfile
CASE = ("api", "case", "size", "queues", "flush")  # a case; its modes are compared


def modes_of(tls: bool, auth: bool) -> list[str]:
    """The modes a run measures: plaintext, then what the flags ask for (both: also
    TLS with authentication)."""
    return [PLAIN, *([TLS] if tls else []), *([AUTH] if auth else []), *([TLS_AUTH] if tls and auth else [])]


@dataclass(frozen=True)
class Mode:
    """What a mode's broker is started with and what its clients connect with."""

    name: str
    broker_env: dict[str, str] = field(default_factory=dict)  # CLMQ_<FIELD> settings of the broker
    client: ClientSecurity = field(default_factory=ClientSecurity)  # the producer's and the consumer's
    admin: ClientSecurity = field(default_factory=ClientSecurity)  # the topic's creator
    users: SecurityState | None = None  # seeded as <data_dir>/security.json before the broker starts

    def seed(self, data_dir: Path) -> None:
        if self.users is not None:
            data_dir.mkdir(parents=True, exist_ok=True)
            save_security(data_dir / SECURITY_FILE, self.users)


def _acls(topic: str) -> list[AclBinding]:
    def allow(kind: ResourceType, name: str, op: Operation) -> AclBinding:
        return AclBinding(kind, name, PatternType.LITERAL, f"User:{BENCH_USER}", "*", op, Permission.ALLOW)

    return [
        allow(ResourceType.TOPIC, topic, Operation.WRITE),
        allow(ResourceType.TOPIC, topic, Operation.READ),
        allow(ResourceType.TOPIC, f"%RETRY%{GROUP}", Operation.READ),  # a consumer reads its retry topic too
        allow(ResourceType.GROUP, GROUP, Operation.READ),
        # A client given broker addresses (no name server) asks BROKER_INFO first.
        allow(ResourceType.CLUSTER, CLUSTER_NAME, Operation.DESCRIBE),
    ]


class Modes:
    """Every mode of a run, made once: the certificates (in ``root``), the users'
    random passwords and the ACLs of the bench's topics."""

    def __init__(self, root: Path, names: list[str], topics: list[str]) -> None:
        self.names = names
        self._modes: dict[str, Mode] = {PLAIN: Mode(PLAIN)}
        tls: TlsSettings | None = None
        broker_tls: dict[str, str] = {}
        if any(TLS in n for n in names):
            from clmq.devtools import make_ca, make_cert

            certs = root / "certs"
            ca = make_ca(certs, "bench-ca")
            server = make_cert(ca, certs, "bench-broker")
            broker_tls = {
                "CLMQ_TLS_CERT_FILE": str(server.cert_file),
                "CLMQ_TLS_KEY_FILE": str(server.key_file),
                "CLMQ_TLS_CA_FILE": str(ca.cert_file),
            }
            tls = TlsSettings(ca_file=str(ca.cert_file))
            self._modes[TLS] = Mode(TLS, broker_tls, ClientSecurity(tls), ClientSecurity(tls))
        if any(AUTH in n for n in names):
            passwords = {BENCH_USER: secrets.token_urlsafe(18), ADMIN_USER: secrets.token_urlsafe(18)}
            users = SecurityState()
            for user, password in passwords.items():
                users = users.with_user(user, [make_credential(MECHANISM, password)])
            users = users.with_acls([b for topic in topics for b in _acls(topic)])
            auth_env = {"CLMQ_AUTH_ENABLED": "true", "CLMQ_SUPER_USERS": f"User:{ADMIN_USER}"}
            for name, over in ((AUTH, None), (TLS_AUTH, tls)):
                if name in names:
                    self._modes[name] = Mode(
                        name,
                        {**auth_env, **(broker_tls if over else {})},
                        ClientSecurity(over, BENCH_USER, passwords[BENCH_USER], MECHANISM),
                        ClientSecurity(over, ADMIN_USER, passwords[ADMIN_USER], MECHANISM),
                        users,
                    )

    def __getitem__(self, name: str) -> Mode:
        return self._modes[name]


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def ratios(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case and mode other than plaintext: the medians of the mode's figures and of
    its ratios to plaintext, each ratio taken within one run (``run`` of the samples)."""
    plain = {(tuple(s[k] for k in CASE), s["run"]): s for s in samples if s.get("mode", PLAIN) == PLAIN}
    groups: dict[tuple[Any, ...], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for s in samples:
        base = plain.get((tuple(s[k] for k in CASE), s["run"]))
        if s.get("mode", PLAIN) != PLAIN and base is not None:
            groups.setdefault((*(s[k] for k in CASE), s["mode"]), []).append((s, base))
    out = []
    for key, pairs in groups.items():

        def med(f: str, pairs: list[tuple[dict[str, Any], dict[str, Any]]] = pairs) -> float:
            return float(statistics.median(s[f] for s, _ in pairs))

        def rat(f: str, pairs: list[tuple[dict[str, Any], dict[str, Any]]] = pairs) -> float:
            return statistics.median(_ratio(s[f], b[f]) for s, b in pairs)

        out.append(
            {
                **dict(zip((*CASE, "mode"), key, strict=True)),
                "runs": len(pairs),
                "produce_msgs_per_s": med("produce_msgs_per_s"),
                "consume_msgs_per_s": med("consume_msgs_per_s"),
                "consume_fetch_msgs_per_s": med("consume_fetch_msgs_per_s"),
                "plain_produce_msgs_per_s": statistics.median(b["produce_msgs_per_s"] for _, b in pairs),
                "plain_consume_msgs_per_s": statistics.median(b["consume_msgs_per_s"] for _, b in pairs),
                "produce_ratio": rat("produce_msgs_per_s"),
                "consume_ratio": rat("consume_msgs_per_s"),
                "consume_fetch_ratio": rat("consume_fetch_msgs_per_s"),
                "produce_broker_cpu_ratio": rat("produce_broker_cpu_us_per_msg"),
                "consume_broker_cpu_ratio": rat("consume_broker_cpu_us_per_msg"),
                "produce_broker_cpu_us_per_msg": med("produce_broker_cpu_us_per_msg"),
                "consume_broker_cpu_us_per_msg": med("consume_broker_cpu_us_per_msg"),
            }
        )
    return out


def aim_of(mode: str, what: str) -> float:
    """The least ratio to plaintext the issue asks of ``mode`` for ``what`` (produce or
    consume): TLS's aims for both TLS modes, authentication's for ``auth``."""
    if TLS in mode:
        return AIM_TLS_PRODUCE_RATIO if what == "produce" else AIM_TLS_CONSUME_RATIO
    return AIM_AUTH_RATIO


def security_aims(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ratio against its aim (``tls+auth`` held to TLS's)."""
    out = []
    for r in rows:
        for what in ("produce", "consume"):
            target = aim_of(r["mode"], what)
            measured = r[f"{what}_ratio"]
            out.append(
                {
                    "api": r["api"],
                    "mode": r["mode"],
                    "aim": f"{what}, {r['mode']} / plain, {r['case']}, {r['size']} B, {r['queues']:,} "
                    f"queue{'' if r['queues'] == 1 else 's'}, {r['flush']} flush",
                    "measured": measured,
                    "want": "≥",
                    "target": target,
                    "ratio": measured / target,
                    "met": measured >= target,
                }
            )
    return out


def summary(samples: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    rows = ratios(samples)
    return {
        "modes": modes,
        "user": BENCH_USER,
        "mechanism": MECHANISM,
        "ratios": rows,
        "aims": security_aims(rows),
    }


def markdown(security: dict[str, Any]) -> str:
    """The modes against plaintext, and the aims, as Markdown."""
    head = (
        "| api | case | size B | queues | flush | mode | produce msgs/s | × plain | consume msgs/s | × plain "
        "| fetch × plain | broker CPU µs/msg produce / consume | × plain |"
    )
    lines = [
        "### TLS and authentication against plaintext",
        "",
        "Ratios: the median over the runs of each run's ratio to the plaintext case measured in the same run.",
        "",
        head,
        "|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in security["ratios"]:
        lines.append(
            f"| {r['api']} | {r['case']} | {r['size']} | {r['queues']:,} | {r['flush']} | {r['mode']} "
            f"| {r['produce_msgs_per_s']:,.0f} | {r['produce_ratio']:.2f} | {r['consume_msgs_per_s']:,.0f} "
            f"| {r['consume_ratio']:.2f} | {r['consume_fetch_ratio']:.2f} "
            f"| {r['produce_broker_cpu_us_per_msg']:.1f} / {r['consume_broker_cpu_us_per_msg']:.1f} "
            f"| {r['produce_broker_cpu_ratio']:.2f} / {r['consume_broker_cpu_ratio']:.2f} |"
        )
    lines += ["", "| aim | api | measured | target | verdict |", "|---|---|---:|---:|---|"]
    for a in security["aims"]:
        lines.append(
            f"| {a['aim']} | {a['api']} | {a['measured']:.2f} | {a['want']} {a['target']:g} "
            f"| {'met' if a['met'] else '**not met**'} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Produce and consume msgs/s per case (api, queues) and mode, each bar labelled
    with its ratio to plaintext, a red tick on each at its aim (plaintext x the aim's
    ratio)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    security = result["security"]
    modes: list[str] = security["modes"]
    rows = [r for r in result["rows"] if r["flush"] == "async"] or result["rows"]
    size = 1024 if any(r["size"] == 1024 for r in rows) else rows[0]["size"]
    rows = [r for r in rows if r["size"] == size]
    cases = list(dict.fromkeys((r["api"], r["queues"]) for r in rows))
    ratio = {(r["api"], r["queues"], r["mode"]): r for r in security["ratios"] if r["size"] == size}
    fig, axes = plt.subplots(1, 2, figsize=(6 + 1.6 * len(cases), 4.8))
    width = 0.8 / len(modes)
    for ax, what in zip(axes, ("produce", "consume"), strict=True):
        for k, mode in enumerate(modes):
            xs, ys, labels, aims = [], [], [], []
            for i, (api, queues) in enumerate(cases):
                r = next((r for r in rows if (r["api"], r["queues"], r["mode"]) == (api, queues, mode)), None)
                if r is None:
                    continue
                xs.append(i - 0.4 + width * (k + 0.5))
                ys.append(r[f"{what}_msgs_per_s"])
                rr = ratio.get((api, queues, mode))
                labels.append(f"{ys[-1] / 1000:.0f}k" + (f"\n{rr[f'{what}_ratio']:.2f}×" if rr else ""))
                aims.append(rr[f"plain_{what}_msgs_per_s"] * aim_of(mode, what) if rr else float("nan"))
            bars = ax.bar(xs, ys, width, label=mode, color=f"C{k}")
            ax.bar_label(bars, labels, fontsize=6)
            if mode != PLAIN:
                first = k == 1  # one legend entry for every mode's aim
                ax.scatter(xs, aims, marker="_", color="red", s=140, zorder=3, label="aim" if first else None)
        ax.set_xticks(range(len(cases)), [f"{api}\n{q:,} queue{'' if q == 1 else 's'}" for api, q in cases])
        ax.set_ylabel("msgs/s")
        ax.set_title(
            f"{what} (labels: msgs/s and × plaintext of the same run)" + (", whole life" if what == "consume" else ""),
            fontsize=9,
        )
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the labels and the legend
        ax.legend(fontsize=7, ncol=len(modes) + 1, loc="upper left")
    fig.suptitle(
        f"clmq bench e2e --tls --auth: {size} B messages, async flush, one broker over loopback, "
        f"medians of {result['runs']} runs (aims: auth ≥ {AIM_AUTH_RATIO}, TLS produce ≥ {AIM_TLS_PRODUCE_RATIO}, "
        f"TLS consume ≥ {AIM_TLS_CONSUME_RATIO} × plaintext)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
