"""The dashboard's HTTP side: static pages, and a JSON API read through the admin client.

Every number comes from the cluster's documented requests (``client.Admin``): what a
person sees is what ``clmq`` would print. A sampler keeps a bounded history of rates
and group lags for the charts.
"""

from __future__ import annotations

import collections
import json
import mimetypes
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import trio

from clmq.client import Admin, ConnectionFailed, NoRouteError, RpcError
from clmq.protocol.transport import HttpRequest, HttpResponse

from ._dashboard_trace import api_trace
from ._output import record_fields
from ._pop_view import pop_rows, pop_totals
from .dlq_verbs import letter_fields
from .replication_verbs import cluster_rows

NET_ERRORS = (ConnectionFailed, RpcError, NoRouteError, trio.TooSlowError, OSError)


@dataclass(frozen=True)
class DashboardSettings:
    poll_interval_ms: int = 2000  # how often rates and lags are sampled for the charts
    history_points: int = 300  # samples kept (300 x 2 s: the last 10 minutes)
    max_page_messages: int = 100  # messages one page of browsing shows at most
    max_sampled_groups: int = 50  # groups whose lag is sampled (the first, by name)

    def __post_init__(self) -> None:
        for name in ("poll_interval_ms", "history_points", "max_page_messages", "max_sampled_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class Dashboard:
    """The state behind the pages: the admin client and the sampled history."""

    def __init__(self, admin: Admin, settings: DashboardSettings) -> None:
        self.admin, self.settings = admin, settings
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=settings.history_points)
        self.last_error = ""

    async def sample_forever(self) -> None:
        while True:
            try:
                self.history.append(await self._sample())
                self.last_error = ""
            except NET_ERRORS as e:
                self.last_error = str(e) or type(e).__name__
            await trio.sleep(self.settings.poll_interval_ms / 1000)

    async def _sample(self) -> dict[str, Any]:
        rates = {"messages_in_per_s": 0.0, "messages_out_per_s": 0.0, "bytes_in_per_s": 0.0, "bytes_out_per_s": 0.0}
        for b in await self.admin.leaders():
            info = await self.admin.broker_info(b["addr"])
            for key in rates:
                rates[key] += float(info.get(key, 0))
        lags = {}
        for group in (await self.admin.list_groups())[: self.settings.max_sampled_groups]:
            info = await self.admin.describe_group(group)
            lags[group] = info["lag"] + pop_totals(info.get("pop") or [])["lag"]
        return {"t": int(time.time() * 1000), **rates, "lag": lags}

    async def route(self, request: HttpRequest) -> HttpResponse:
        if request.path.startswith("/api/"):
            handler = API.get(request.path.removeprefix("/api/"))
            if handler is None:
                return _json({"error": f"no API {request.path}"}, 404)
            try:
                return _json(await handler(self, request.query))
            except (KeyError, ValueError) as e:
                return _json({"error": f"bad request: {e}"}, 400)
            except NET_ERRORS as e:
                return _json({"error": str(e) or type(e).__name__}, 502)
        return _static(request.path)


def _json(doc: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, json.dumps(doc, default=str).encode(), "application/json")


def _static(path: str) -> HttpResponse:
    name = "index.html" if path in ("", "/") else path.lstrip("/")
    if ".." in name.split("/"):
        return HttpResponse(404, b"not found\n")
    files = resources.files("clmq.broker.cli") / "dashboard_static"
    target = files.joinpath(*name.split("/"))
    if not target.is_file():
        return HttpResponse(404, b"not found\n")
    kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return HttpResponse(
        200,
        target.read_bytes(),
        kind + ("; charset=utf-8" if kind.startswith("text/") or kind.endswith("javascript") else ""),
    )


# ------------------------------------------------------------------------ the API
async def api_overview(d: Dashboard, q: dict[str, str]) -> dict[str, Any]:
    brokers = await cluster_rows(d.admin)
    for b in brokers:
        try:
            b["info"] = await d.admin.broker_info(b["addr"])
        except NET_ERRORS as e:
            b["info"] = {"error": str(e)}
    return {"brokers": brokers, "history": list(d.history), "sampler_error": d.last_error}


async def api_topics(d: Dashboard, q: dict[str, str]) -> dict[str, Any]:
    return {"topics": await d.admin.list_topics()}


async def api_topic(d: Dashboard, q: dict[str, str]) -> dict[str, Any]:
    rows = await d.admin.describe_topic(q["name"])
    if not rows:
        raise ValueError(f"no broker has topic {q['name']!r}")
    return {"topic": q["name"], "queues": rows}


async def api_groups(d: Dashboard, q: dict[str, str]) -> dict[str, Any]:
    """Every group (those with only dead letters too): lag, members, queues, retry
    backlog and dead letters."""
    out = []
    with_letters = {r["group"] for r in await d.admin.dead_letter_counts()}
    for group in sorted(set(await d.admin.list_groups()) | with_letters):
        info = await d.admin.describe_group(group)
        pop = pop_totals(info.get("pop") or [])
        out.append(
            {
                "group": group,
                "lag": info["lag"] + pop["lag"],
                "members": len(info["members"]) + len(pop["members"]),
                "queues": len(info["queues"]),
                "retry_backlog": info["retry_backlog"],
                "dead_letters": info["dead_letters"],
                "pop": bool(info.get("pop")),
                "inflight": pop["inflight"],
                "redelivering": pop["redelivering"],
                "redelivered": pop["redelivered"],
            }
        )
    return {"groups": out}


async def api_group(d: Dashboard, q: dict[str, str]) -> dict[str, Any]:
    info = await d.admin.describe_group(q["name"])
    pops = info.get("pop") or []
    if not (info["queues"] or info["members"] or info["dead_letters"] or info["retry_backlog"] or pops):
        raise ValueError(f"group {q['name']!r} does not exist")
    trend = [{"t": h["t"], "lag": h["lag"].get(q["name"])} for h in d.history if q["name"] in h["lag"]]
    # POP groups (docs/consuming.md): per queue next/settled offsets, in flight, redelivering; the totals
    return {**info, "pop_queues": pop_rows(pops), "pop_totals": pop_totals(pops), "trend": trend}


async def api_messages(d: Dashboard, q: dict[str, str]) -> dict[str, Any]:
    count = min(int(q.get("count", "20")), d.settings.max_page_messages)
    records = await d.admin.read_queue(q["topic"], int(q["queue"]), int(q.get("offset", "0")), count)
    return {"messages": [record_fields(r) for r in records]}


async def api_message(d: Dashboard, q: dict[str, str]) -> dict[str, Any]:
    rec = await d.admin.message_by_id(q["id"])
    if rec is None:
        raise ValueError(f"no message {q['id']}")
    return {"messages": [record_fields(rec, q["id"])]}


async def api_find(d: Dashboard, q: dict[str, str]) -> dict[str, Any]:
    found = await d.admin.messages_by_key(q["topic"], q["key"], max_messages=d.settings.max_page_messages)
    return {"messages": [record_fields(r) for r in found.records], "scanned": found.scanned, "complete": found.complete}


async def api_dead_letters(d: Dashboard, q: dict[str, str]) -> dict[str, Any]:
    """A group's dead letters (``clmq dlq show``): id, origin, attempts, body."""
    count = min(int(q.get("count", "20")), d.settings.max_page_messages)
    letters = await d.admin.dead_letters(q["group"], max_messages=count, start=int(q.get("offset", "0")))
    return {"group": q["group"], "messages": [letter_fields(lt) for lt in letters]}


API = {
    "overview": api_overview,
    "topics": api_topics,
    "topic": api_topic,
    "groups": api_groups,
    "group": api_group,
    "messages": api_messages,
    "message": api_message,
    "find": api_find,
    "deadletters": api_dead_letters,
    "trace": api_trace,  # a message's trace events (docs/traces.md)
}
