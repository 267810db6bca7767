"""The slot mirror: R3 rows beside each physical KV slot, for vLLM's own prefix-cache hits.

vLLM's KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token *slots*; slot ``b * block_size +
i`` holds the KV of one token. When a new request hits vLLM's own prefix cache it reuses those blocks without
running the tokens again, so their routing must come from wherever the KV came from: the mirror keeps one R3
row per slot, written in the same step that writes the slot's KV, and read through the block table of a
request that holds the blocks.

Two rules make a read exact:

* every write of KV into a slot is matched by a write of its row (computed in a step, or loaded with an
  external KV hit), so a slot's row always belongs to the KV in that slot;
* reads go only through blocks a live request holds: vLLM never reuses a held block, so its slots cannot
  change under the read.

For example, with ``block_size=16`` a request holding blocks ``[7, 3]`` reads positions ``[0, 20)`` from slots
``112..127`` then ``48..51``.

All operations are vectorized (one numpy gather or scatter per call). A step's rows can also be *queued*
(:meth:`SlotMirror.queue`, a list append): queued rows are applied in order before the next write, read or
forget, and at least every ``max_queued_rows`` rows, so the many decode steps between two reads cost one
scatter instead of one each, and no read ever sees the mirror without them. The mirror is sized to the KV pool:
``num_blocks * block_size * bytes_per_token`` bytes, allocated zeroed so the OS commits pages only when
written. A slot never written reads as an error, not as zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lmcache_r3.artifacts.profile import R3Profile


class SlotMirrorError(ValueError):
    """A write or read the mirror refuses; the message names the slot, block or position."""


class SlotMirror:
    """One R3 row per physical KV slot (see the module docstring)."""

    def __init__(self, profile: R3Profile, num_blocks: int, block_size: int) -> None:
        """Args:
        profile: the row profile.
        num_blocks: blocks in the KV pool (``num_gpu_blocks`` of the KV cache config).
        block_size: token slots per block.
        """
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int from the KV cache config, got {value!r}")
        self.profile = profile
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self._rows = np.zeros((self.num_slots, *profile.row_shape), dtype=profile.dtype)
        self._written = np.zeros(self.num_slots, dtype=bool)
        self._queued: list[tuple[np.ndarray, np.ndarray]] = []
        self._queued_rows = 0
        self.max_queued_rows = 8192
        """Queued rows past this are applied at once (bounds the memory the queue holds)."""

    @property
    def nbytes(self) -> int:
        """Bytes reserved for rows and their written flags (the OS commits pages as they are touched)."""
        return self._rows.nbytes + self._written.nbytes

    def write(self, slot_ids: np.ndarray | Sequence[int], rows: np.ndarray) -> None:
        """Store one step's rows at their slots.

        Args:
            slot_ids: ``[n]`` slot of each row (the step's ``slot_mapping``); negative ids (vLLM's padding
                slot, -1) are skipped.
            rows: ``[n, num_layers, top_k]`` in the profile dtype.

        Raises:
            SlotMirrorError: length mismatch, wrong dtype or shape, or a slot id past the pool.
        """
        self._apply_queued()
        slots = self._checked(slot_ids, rows)
        self._check_pool(slots)
        self._scatter(slots, rows)

    def queue(self, slot_ids: np.ndarray, rows: np.ndarray) -> None:
        """Like :meth:`write`, applied before the next write, read or forget (see the module docstring).

        The arrays are kept, not copied: the caller must not change them afterwards.

        Raises:
            SlotMirrorError: as :meth:`write`; nothing of a refused step is queued, and the steps queued before it
                stay queued.
        """
        slots = self._checked(slot_ids, rows)
        self._check_pool(slots)
        self._queued.append((slots, rows))
        self._queued_rows += slots.shape[0]
        if self._queued_rows >= self.max_queued_rows:
            self._apply_queued()

    def _apply_queued(self) -> None:
        if not self._queued:
            return
        queued, self._queued, self._queued_rows = self._queued, [], 0
        if len(queued) == 1:
            slots, rows = queued[0]
        else:
            slots = np.concatenate([slots for slots, _ in queued])
            rows = np.concatenate([rows for _, rows in queued])
            # A slot written by two steps (a recomputed position) keeps the newer row: numpy does not say which
            # of two equal indices of one scatter wins, so only the last occurrence of each slot is scattered.
            _, last_from_end = np.unique(slots[::-1], return_index=True)
            newest = slots.shape[0] - 1 - last_from_end
            slots, rows = slots[newest], rows[newest]
        self._scatter(slots, rows)  # every queued step's slots were checked by queue()

    def _checked(self, slot_ids: np.ndarray | Sequence[int], rows: np.ndarray) -> np.ndarray:
        slots = np.asarray(slot_ids)
        if slots.ndim != 1 or slots.dtype.kind not in "iu":
            raise SlotMirrorError(f"slot_ids must be a 1-D integer array, got {slots.dtype} of shape {slots.shape}")
        if rows.dtype != self.profile.dtype or rows.shape != (slots.shape[0], *self.profile.row_shape):
            raise SlotMirrorError(
                f"rows must be {self.profile.dtype} of shape [{slots.shape[0]}, {self.profile.num_layers}, "
                f"{self.profile.top_k}] (one per slot id), got {rows.dtype} of shape {rows.shape}"
            )
        return slots

    def _check_pool(self, slots: np.ndarray) -> None:
        if slots.size and slots.max() >= self.num_slots:
            raise SlotMirrorError(
                f"slot id {int(slots.max())} is past the pool of {self.num_slots} slots "
                f"({self.num_blocks} blocks x {self.block_size}); "
                f"the mirror must be built from the same KV cache config as the engine"
            )

    def _scatter(self, slots: np.ndarray, rows: np.ndarray) -> None:
        real = slots >= 0
        if not real.all():
            slots, rows = slots[real], rows[real]
        self._rows[slots] = rows
        self._written[slots] = True

    def slots_for(self, block_ids: np.ndarray | Sequence[int], start: int, end: int) -> np.ndarray:
        """The slots of positions ``[start, end)`` of a request whose block table is ``block_ids``.

        Raises:
            SlotMirrorError: negative or inverted range, a block table too short, or an invalid block id.
        """
        blocks = self._table(block_ids, start, end)
        positions = np.arange(start, end, dtype=np.int64)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def _table(self, block_ids: np.ndarray | Sequence[int], start: int, end: int) -> np.ndarray:
        """``block_ids`` as int64, checked to cover ``[start, end)`` with blocks of the pool."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        if type(start) is not int or type(end) is not int or not 0 <= start <= end:
            raise SlotMirrorError(f"positions must satisfy 0 <= start <= end, got [{start!r}, {end!r})")
        if blocks.ndim != 1 or blocks.shape[0] * self.block_size < end:
            raise SlotMirrorError(
                f"block table of {blocks.size} blocks x {self.block_size} covers "
                f"{blocks.size * self.block_size} positions, fewer than the {end} needed for [{start}, {end})"
            )
        used = blocks[start // self.block_size : -(-end // self.block_size)]
        if used.size and (used.min() < 0 or used.max() >= self.num_blocks):
            bad = used[(used < 0) | (used >= self.num_blocks)][0]
            raise SlotMirrorError(f"block id {int(bad)} is outside the pool of {self.num_blocks} blocks")
        return blocks

    def read(self, block_ids: np.ndarray | Sequence[int], start: int, end: int) -> np.ndarray:
        """Rows of positions ``[start, end)`` of a request that holds the blocks ``block_ids``.

        Args:
            block_ids: the request's block table for the attention group, position order.
            start: first position to read.
            end: position after the last one to read.

        Returns:
            A new ``[end - start, num_layers, top_k]`` array.

        Raises:
            SlotMirrorError: invalid positions or blocks, or a slot that was never written (its KV did not
                come through a path that also wrote its row).
        """
        self._apply_queued()
        size = self.block_size
        first_block = start // size
        table = self._table(block_ids, start, end)[first_block : -(-end // size)]
        # Whole blocks are gathered (a block's slots are contiguous), then the range is cut out of them.
        cut = slice(start - first_block * size, end - first_block * size)
        written = self._written.reshape(self.num_blocks, size)[table].reshape(-1)[cut]
        if not written.all():
            first = int(np.argmin(written))
            block = int(table[(start + first) // size - first_block])
            raise SlotMirrorError(
                f"no R3 row was written for position {start + first} "
                f"(block {block}, slot {block * size + (start + first) % size}); "
                f"every KV write into a slot must also write its row to the mirror"
            )
        rows = self._rows.reshape(self.num_blocks, size, *self.profile.row_shape)[table]
        return rows.reshape(-1, *self.profile.row_shape)[cut]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy every slot's row and written flag of block ``src`` to block ``dst``, per ``(src, dst)`` in order (the
        rows of a block vLLM copied on write, as its KV was)."""
        self._apply_queued()
        pairs = self._block_ids(copies).reshape(-1, 2)
        rows = self._rows.reshape(self.num_blocks, self.block_size, *self.profile.row_shape)
        written = self._written.reshape(self.num_blocks, self.block_size)
        for src, dst in pairs:
            rows[dst] = rows[src]
            written[dst] = written[src]

    def _block_ids(self, block_ids: object) -> np.ndarray:
        """``block_ids`` as an int64 array; SlotMirrorError when one is outside the mirror."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise SlotMirrorError(f"block ids must be in [0, {self.num_blocks}), got {blocks.tolist()}")
        return blocks

    def forget_blocks(self, block_ids: np.ndarray | Sequence[int]) -> None:
        """Mark every slot of ``block_ids`` unwritten (e.g. after the engine resets its prefix cache)."""
        self._apply_queued()
        blocks = self._block_ids(block_ids)
        self._written.reshape(self.num_blocks, self.block_size)[blocks] = False  # whole blocks: no slot index built
