"""Request assembly: one request's R3 rows, kept by logical token position.

A request's *rows* are indexed by the logical position of the token they belong to (row ``i`` is the routing
of token ``i``), never by the physical KV slot that token happened to use: a slot can be freed and reused once
a step is over, a position cannot. Rows arrive from several places in any order (fetched chunks of a cache
hit, the slot mirror for vLLM's own prefix hits, and each model step), and the same position may arrive more
than once (recomputation after preemption, a rejected speculative tail written again). The rules:

* the rows present always form **one contiguous range** ``[present.start, present.end)``;
* a write may overwrite any part of it (the newest rows win) and may extend it on either side, but a write
  that would leave a **gap** is rejected;
* ``truncate(end)`` forgets every row at or after ``end``;
* ``materialize(num_tokens)`` returns rows ``[0, num_tokens - 1)`` (the last sampled token never ran, so it
  has no row) and fails, naming the missing ranges, unless every one of them is present.

Publication. With chunk size ``C`` the store holds chunk ``k`` = rows ``[k*C, (k+1)*C)``. Lookups in the store
stop at the first missing chunk, so a request publishes a *prefix* of its chunks: ``published_end`` is a
chunk-aligned watermark, :meth:`RequestRows.ready_chunks` returns the full chunks from the watermark that are
present, and :meth:`RequestRows.mark_published` advances it once the caller has stored them (or knows the
store already has them, as for chunks fetched from it). A later overwrite of rows below the watermark changes
what ``materialize`` returns but does not offer the chunk again: stored objects are immutable snapshots keyed
by token content, and the one already stored was consistent with the KV stored beside it. ``truncate`` below
the watermark lowers it to the truncated chunk boundary, so those chunks are offered again once rewritten;
storing an existing key again is a no-op.

Rows live in one growable contiguous array (capacity doubles). ``materialize`` hands out a read-only view of it
without copying; the next write copies the storage first, so an array already handed out never changes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lmcache_r3.artifacts.profile import R3Profile


class TokenRange(NamedTuple):
    """A half-open range of token positions ``[start, end)``."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return max(0, self.end - self.start)

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


EMPTY = TokenRange(0, 0)


class R3AssemblyError(ValueError):
    """Base of every refusal by :class:`RequestRows`."""


class RowGapError(R3AssemblyError):
    """A write would leave positions without rows between what is present and what is written."""


class MissingRowsError(R3AssemblyError):
    """Rows needed for materialization or a read are not present."""

    def __init__(self, message: str, missing: list[TokenRange]) -> None:
        super().__init__(message)
        self.missing = missing
        """The missing ranges, in position order."""


def _require_position(name: str, value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative int token position, got {value!r}")
    return value


def missing_ranges(present: TokenRange, needed: TokenRange) -> list[TokenRange]:
    """The parts of ``needed`` that ``present`` does not cover.

    Args:
        present: the contiguous range of positions that have rows (may be empty).
        needed: the range of positions required.

    Returns:
        Zero, one or two ranges in position order; e.g. present ``[256, 1000)`` and needed ``[0, 1023)`` give
        ``[0, 256)`` and ``[1000, 1023)``.
    """
    if needed.end <= needed.start:
        return []
    if present.end <= present.start:
        return [needed]
    gaps = []
    if needed.start < present.start:
        gaps.append(TokenRange(needed.start, min(needed.end, present.start)))
    if needed.end > present.end:
        gaps.append(TokenRange(max(needed.start, present.end), needed.end))
    return gaps


class RequestRows:
    """The R3 rows of one request, by logical token position (see the module docstring for the rules)."""

    def __init__(self, profile: R3Profile, chunk_size: int, capacity_tokens: int = 0) -> None:
        """Args:
        profile: the row profile; every write must be in its dtype and row shape.
        chunk_size: tokens per stored chunk (the LMCache chunk size), for publication.
        capacity_tokens: rows to allocate up front (prompt + max output tokens avoids regrowth).
        """
        if type(chunk_size) is not int or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int (the LMCache chunk size), got {chunk_size!r}")
        self.profile = profile
        self.chunk_size = chunk_size
        self._storage = np.empty(
            (_require_position("capacity_tokens", capacity_tokens), *profile.row_shape), dtype=profile.dtype
        )
        self._present = EMPTY
        self._published_end = 0
        self._handed_out = False

    @property
    def present(self) -> TokenRange:
        """The contiguous range of positions that have rows; ``[0, 0)`` when none."""
        return self._present

    @property
    def published_end(self) -> int:
        """Chunk-aligned watermark: chunks below it were published (or already in the store)."""
        return self._published_end

    @property
    def nbytes(self) -> int:
        """Bytes allocated for rows (capacity, not just what is present)."""
        return self._storage.nbytes

    def _prepare_storage(self, end: int) -> None:
        """Make room for rows up to ``end``, and stop sharing memory with an array handed out earlier."""
        capacity = self._storage.shape[0]
        if end <= capacity and not self._handed_out:
            return
        if end > capacity:
            capacity = max(end, 2 * capacity)
        fresh = np.empty((capacity, *self.profile.row_shape), dtype=self.profile.dtype)
        start, stop = self._present
        fresh[start:stop] = self._storage[start:stop]
        self._storage = fresh
        self._handed_out = False

    def write(self, start: int, rows: np.ndarray) -> None:
        """Store ``rows`` at positions ``[start, start + len(rows))``, overwriting any rows already there.

        Args:
            start: logical position of ``rows[0]``.
            rows: ``[n, num_layers, top_k]`` in the profile dtype; ``n == 0`` is a no-op.

        Raises:
            TypeError, ValueError: wrong dtype or shape, negative start.
            RowGapError: the write neither overlaps nor touches the present range.
        """
        _require_position("start", start)
        if not isinstance(rows, np.ndarray) or rows.dtype != self.profile.dtype:
            raise TypeError(
                f"rows must be a numpy array of {self.profile.dtype} ({self.profile.describe()}), got "
                f"{getattr(rows, 'dtype', type(rows).__name__)}; narrow them first with narrow_rows"
            )
        if rows.ndim != 3 or rows.shape[1:] != self.profile.row_shape:
            raise ValueError(
                f"rows have shape {rows.shape}, expected [n, {self.profile.num_layers}, {self.profile.top_k}]"
            )
        end = start + rows.shape[0]
        if end == start:
            return
        present = self._present
        if present.end > present.start and (start > present.end or end < present.start):
            raise RowGapError(
                f"writing rows {TokenRange(start, end)} would leave a gap next to the present rows "
                f"{present}; "
                f"write the rows in between first (fetched chunks, prefix-cache rows or the skipped step)"
            )
        self._prepare_storage(end)
        self._storage[start:end] = rows
        if present.end > present.start:
            self._present = TokenRange(min(start, present.start), max(end, present.end))
        else:
            self._present = TokenRange(start, end)

    def truncate(self, end: int) -> None:
        """Forget every row at position ``end`` or later (a rejected speculative tail, a reset).

        Args:
            end: first position to forget; rows ``[present.start, end)`` stay.

        Raises:
            ValueError: negative ``end``.
        """
        _require_position("end", end)
        present = self._present
        if end <= present.start:
            self._present = EMPTY
        elif end < present.end:
            self._present = TokenRange(present.start, end)
        self._published_end = min(self._published_end, end - end % self.chunk_size)

    def rows(self, start: int, end: int) -> np.ndarray:
        """A read-only view of rows ``[start, end)``; valid until the next write or truncate.

        Raises:
            MissingRowsError: part of the range is not present.
        """
        needed = TokenRange(_require_position("start", start), _require_position("end", end))
        missing = missing_ranges(self._present, needed)
        if missing:
            raise MissingRowsError(
                f"rows {needed} requested but {', '.join(map(str, missing))} missing (present {self._present})",
                missing,
            )
        view = self._storage[start:end]
        view.flags.writeable = False
        return view

    def materialize(self, num_tokens: int) -> np.ndarray:
        """The request's R3: rows ``[0, num_tokens - 1)`` as a new array ``[num_tokens - 1, layers, top_k]``.

        Args:
            num_tokens: prompt + output tokens of the request; the last one never ran, so it has no row.

        Returns:
            A read-only array that never changes afterwards (later writes copy the storage first); it shares
            memory with the assembly until then, so materializing costs no copy.

        Raises:
            MissingRowsError: rows in ``[0, num_tokens - 1)`` are not present; the message names them.
        """
        if type(num_tokens) is not int or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int (prompt + output tokens), got {num_tokens!r}")
        needed = TokenRange(0, num_tokens - 1)
        missing = missing_ranges(self._present, needed)
        if missing:
            raise MissingRowsError(
                f"cannot materialize R3 for {num_tokens} tokens: rows {', '.join(map(str, missing))} "
                f"are missing (present {self._present}); the routing of those tokens was never received, "
                f"so the request must be recomputed or returned without routed experts",
                missing,
            )
        routed = self._storage[: needed.end]
        routed.flags.writeable = False
        self._handed_out = True
        return routed

    def ready_chunks(self, limit_end: int | None = None) -> list[TokenRange]:
        """Full chunks ``[k*C, (k+1)*C)`` from the publication watermark whose rows are all present.

        Args:
            limit_end: publish nothing past this position (e.g. the KV store window's end); None: no limit.

        Returns:
            Consecutive chunk ranges from ``published_end``; empty when the rows at the watermark are missing.
        """
        present, size = self._present, self.chunk_size
        if present.start > self._published_end:
            return []
        end = present.end if limit_end is None else min(present.end, limit_end)
        last = end - end % size
        return [TokenRange(k, k + size) for k in range(self._published_end, last, size)]

    def mark_published(self, end: int) -> None:
        """Advance the watermark to ``end`` once chunks ``[published_end, end)`` are in the store.

        Args:
            end: a multiple of the chunk size, not below the watermark, with every row up to it present.

        Raises:
            ValueError: ``end`` is not chunk-aligned or is below the watermark.
            MissingRowsError: rows in ``[published_end, end)`` are not present.
        """
        _require_position("end", end)
        if end % self.chunk_size or end < self._published_end:
            raise ValueError(
                f"mark_published(end={end}): end must be a multiple of the chunk size {self.chunk_size} "
                f"and not below the current watermark {self._published_end}"
            )
        missing = missing_ranges(self._present, TokenRange(self._published_end, end))
        if missing:
            raise MissingRowsError(
                f"cannot mark chunks up to {end} published: rows {', '.join(map(str, missing))} are "
                f"not present; "
                f"write the rows of every chunk before publishing it",
                missing,
            )
        self._published_end = end
