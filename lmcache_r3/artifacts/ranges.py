"""Token ranges: half-open ``[start, end)`` spans of token positions, the unit every plan and R3 object speaks in."""

from __future__ import annotations

from typing import NamedTuple


class TokenRange(NamedTuple):
    """A half-open range of token positions ``[start, end)``."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return max(0, self.end - self.start)

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"
