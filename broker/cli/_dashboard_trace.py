"""The dashboard's trace of a message (``/api/trace?id=ID`` or ``?key=K&ktopic=T``):
:meth:`Admin.trace` as JSON, with the rows ``clmq message trace`` prints, which the
message page shows as a timeline under the message."""

from __future__ import annotations

from typing import Any

from ._trace_view import trace_rows


async def api_trace(d: Any, q: dict[str, str]) -> dict[str, Any]:
    """``d``: the Dashboard (its ``admin`` and ``settings``); ``q``: ``id``, or ``key``
    with an optional ``ktopic``."""
    trace = await d.admin.trace(
        q.get("id") or None,
        key=q.get("key") or None,
        topic=q.get("ktopic") or None,
        max_events=d.settings.max_page_messages,
    )
    return {**trace.to_json(), "rows": trace_rows(trace.events)}
