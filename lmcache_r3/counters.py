"""Named monotonic counters that several threads update: what a component did, for logs, ``/status`` and tests."""

from __future__ import annotations

import threading


class Counters:
    """A fixed set of named counters starting at 0; an unknown name is a programming error (KeyError)."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, int] = dict.fromkeys(names, 0)

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self.values[name] += value

    def update(self, **increments: int) -> None:
        """Several counters at once, under one lock."""
        with self._lock:
            for name, value in increments.items():
                self.values[name] += value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)
