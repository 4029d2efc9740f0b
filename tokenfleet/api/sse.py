"""Server-Sent Events framing."""

from __future__ import annotations

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PING = ": ping\n\n"


def sse_event(data: str, event_id: str | int | None = None, event: str | None = None) -> str:
    """One event; multi-line data is split into several data lines as the SSE format requires."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return "\n".join(lines) + "\n\n"
