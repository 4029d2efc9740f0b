"""Server-Sent Events framing."""

from __future__ import annotations

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PING = ": ping\n\n"


def sse_event(data: str, event_id: str | int | None = None, event: str | None = None) -> str:
    """One event; multi-line data is split into several data lines as the SSE format requires."""
    if "\n" not in data:  # a JSON chunk: one data line (the path of every streamed event, so no list to join)
        if event_id is None and event is None:
            return f"data: {data}\n\n"
        if event is None:
            return f"id: {event_id}\ndata: {data}\n\n"
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return "\n".join(lines) + "\n\n"
