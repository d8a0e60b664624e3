"""Thread-safe byte and call counters: what went over the wire (protobuf payload sizes)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["TrafficCounter", "TrafficSnapshot"]


@dataclass(frozen=True)
class TrafficSnapshot:
    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    errors: int = 0


@dataclass
class TrafficCounter:
    """Counts serialized message bytes in each direction plus calls and failed calls."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def sent(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n

    def received(self, n: int) -> None:
        with self._lock:
            self.bytes_received += n

    def call(self, ok: bool = True) -> None:
        with self._lock:
            self.calls += 1
            self.errors += 0 if ok else 1

    def snapshot(self) -> TrafficSnapshot:
        with self._lock:
            return TrafficSnapshot(self.bytes_sent, self.bytes_received, self.calls, self.errors)
