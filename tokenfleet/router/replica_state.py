"""What the router believes about one replica's load: its own live count of requests there, plus only what the
replica's last load report knows that the router does not (other gateways' requests), plus the prefill work queued.

The live count moves with every request this router sends or finishes; a report is up to `load_interval_s` old. So
the figure is never the larger of the two (the report counts this router's requests too, as they were a moment ago:
taking the max ran ahead of the live count in a quarter of the samples, by up to 5 requests in the routing
benchmark), but the live count plus the report's surplus over what this router had there when the report was made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Queued prefill tokens worth one running sequence: the engine's default per-step token budget, so a replica with
# 2048 tokens of prefill queued is about one step (one sequence's worth of delay) busier.
TOKENS_PER_SLOT = 2048


@dataclass(frozen=True)
class ReportMark:
    """What this router had sent to a replica when it asked for a load report (see ReplicaState.mark)."""

    in_flight: int
    started: int


@dataclass
class ReplicaState:
    name: str
    in_flight: int = 0  # what this router sent and has not finished (its own count, always fresh)
    started: int = 0  # every request this router ever sent here: what it may have known of while a report was made
    # the rest is the replica's last load report (GET /load)
    running: int = 0
    waiting: int = 0
    queued_tokens: int = 0  # prefill tokens of queued requests
    kv_usage: float = 0.0
    unseen: int = 0  # sequences the last report counted beyond this router's own: other gateways' requests
    healthy: bool = True
    prefill_tokens_per_s: float = 0.0  # measured while prefill work was queued (0: not yet)
    # the last report's prefilled total, its time, and whether prefill work was queued then
    _prefill_count: tuple[int, float, bool] | None = field(default=None, repr=False)

    def sequences(self) -> int:
        """Sequences on the replica: this router's, live, and the others the last report saw."""
        return self.in_flight + self.unseen

    def load(self) -> float:
        """How busy, in sequences: the live count, the other gateways' sequences, and queued prefill tokens as the
        work a count of requests misses (a waiting 8k-token prompt delays the next request far more than a waiting
        10-token one). `kv_usage` is left out: it says how close the replica is to preempting, which the replica
        handles itself, and counting it would push traffic away from replicas that are merely warm."""
        return self.in_flight + self.unseen + self.queued_tokens / TOKENS_PER_SLOT

    def begin(self) -> None:
        """This router sent the replica a request."""
        self.in_flight += 1
        self.started += 1

    def end(self) -> None:
        """One of this router's requests there finished (or failed)."""
        self.in_flight -= 1

    def mark(self) -> ReportMark:
        """Taken just before asking for a load report: what the report may count as this router's own."""
        return ReportMark(self.in_flight, self.started)

    def reported(
        self, running: int, waiting: int, queued_tokens: int, kv_usage: float, mark: ReportMark | None = None
    ) -> None:
        """A load report arrived. `mark`: taken when it was asked for (None: now). The report counted at most the
        requests this router had there then plus those it sent while the report was on its way; anything beyond
        that is someone else's."""
        self.running, self.waiting, self.queued_tokens, self.kv_usage = running, waiting, queued_tokens, kv_usage
        mark = mark or self.mark()
        known = mark.in_flight + (self.started - mark.started)
        self.unseen = max(0, running + waiting - known)

    def count_prefill(self, total: int, at: float) -> None:
        """The report's count of prompt tokens prefilled so far, after `reported`. Between two reports with prefill
        work queued at the first, the replica prefilled as fast as it can beside its decodes: that rate (smoothed)
        is what projects the time to first token. A stretch that was idle at either end says nothing about it."""
        queued = self.queued_tokens > 0 or self.waiting > 0
        last, self._prefill_count = self._prefill_count, (total, at, queued)
        # total < last: the replica restarted
        if last is None or not (last[2] and queued) or at <= last[1] or total < last[0]:
            return
        rate = (total - last[0]) / (at - last[1])
        self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else 0.5 * (self.prefill_tokens_per_s + rate)
