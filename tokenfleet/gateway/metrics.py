"""The gateway's own Prometheus metrics (requests, streams, resumes, cancels)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class GatewayMetrics:
    def __init__(self, active_streams) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tokenfleet_gateway_requests", "Requests by endpoint and status.",
                                ["endpoint", "status"], registry=self.registry)
        self.stream_endings = Counter("tokenfleet_gateway_stream_endings", "Client streams by how they ended.",
                                      ["how"], registry=self.registry)
        self.resumes = Counter("tokenfleet_gateway_resumes", "Streams resumed with Last-Event-ID.",
                               registry=self.registry)
        self.cancels = Counter("tokenfleet_gateway_cancels", "Generations stopped early: by the cancel API, or "
                               "abandoned (the client left and did not resume in time).", ["reason"],
                               registry=self.registry)
        Gauge("tokenfleet_gateway_active_relays", "Generations being relayed now.",
              registry=self.registry).set_function(active_streams)

    def render(self) -> bytes:
        return generate_latest(self.registry)
