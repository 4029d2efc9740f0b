"""Consistent hashing: each replica owns many points (virtual nodes) on a 64-bit ring.

A key's preference order is the replicas met walking clockwise from the key's point. Adding or removing one replica
only changes the order for keys whose walk meets that replica's points first, about 1/N of them.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable


def ring_point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


ORDER_NAMES_KEPT = 1 << 20  # remembered orders hold at most this many names in all (then all are forgotten)


class HashRing:
    def __init__(self, replicas: Iterable[str] = (), vnodes: int = 100) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        self.vnodes = vnodes
        self._ring: list[tuple[int, str]] = []  # (point, owner), sorted; equal points ordered by name
        self._points: list[int] = []  # the points alone, for bisect
        self._replicas: set[str] = set()
        # order() by the ring position a key lands on (keys landing between the same two points share it), while
        # the ring does not change
        self._orders: dict[int, list[str]] = {}
        for replica in replicas:
            self.add(replica)

    @property
    def replicas(self) -> frozenset[str]:
        return frozenset(self._replicas)

    def __len__(self) -> int:
        return len(self._replicas)

    def __contains__(self, replica: object) -> bool:
        return replica in self._replicas

    def add(self, replica: str) -> None:
        if replica in self._replicas:
            return
        self._replicas.add(replica)
        points = [(ring_point(f"{replica}#{i}".encode()), replica) for i in range(self.vnodes)]
        self._ring = sorted(self._ring + points)
        self._points = [point for point, _ in self._ring]
        self._orders.clear()

    def remove(self, replica: str) -> None:
        if replica not in self._replicas:
            return
        self._replicas.discard(replica)
        self._ring = [entry for entry in self._ring if entry[1] != replica]
        self._points = [point for point, _ in self._ring]
        self._orders.clear()

    def order(self, key: bytes) -> list[str]:
        """Every replica once, in ring order from the key's point: the key's first choice, then its fallbacks."""
        if not self._ring:
            return []
        start = bisect.bisect_left(self._points, ring_point(key)) % len(self._ring)
        order = self._orders.get(start)
        if order is None:
            if len(self._orders) * len(self._replicas) >= ORDER_NAMES_KEPT:
                self._orders.clear()
            order = self._orders[start] = self._walk(start)
        return list(order)

    def _walk(self, start: int) -> list[str]:
        seen: dict[str, None] = {}
        n = len(self._ring)
        for step in range(n):
            seen.setdefault(self._ring[(start + step) % n][1])
            if len(seen) == len(self._replicas):
                break
        return list(seen)
