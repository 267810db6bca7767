"""Pure planning for the LMCache MP connector: what a request retrieves, what it stores, which locks it frees.

The connector gathers a request's state (hit counts, the count the scheduler admitted, its block tables), calls a
function here, and acts on the result. Nothing here does I/O or imports vLLM or LMCache; every input is an int or
a list of ints, every token range is half-open ``[start, end)`` in tokens, and every result is a frozen struct.

Vocabulary:

* A *chunk* is LMCache's unit of storage: ``chunk_size`` consecutive tokens starting at a multiple of
  ``chunk_size``. Objects are keyed by a hash of the whole prefix up to their chunk, so the objects of a request
  form a contiguous prefix: chunk ``k`` is only ever found after chunks ``0..k-1``.
* An *engine group* is one paged-block address space of the engine (one of vLLM's KV cache groups). Group ``g``
  holds one block id per ``tokens_per_block[g]`` tokens, so block ``i`` of the group holds tokens
  ``[i * tokens_per_block, (i + 1) * tokens_per_block)``. ``tokens_per_block`` either divides ``chunk_size``
  (several blocks per chunk) or is a multiple of it (several chunks per block); ``0`` marks a scratch group that
  is never transferred.
* The *null block* (vLLM's block id 0) is the placeholder that pads block tables. Its page is shared by every
  group and every request and must stay zero. Hybrid (recurrent + attention) managers put it in a request's
  recurrent table wherever the request owns no checkpoint: a request resumed at 4,608 of 12,288 tokens with a
  1,536-token recurrent cadence carries ``[0, 0, c2, w]``.
* A *destination* is a block a retrieve writes into. ``SKIPPED_BLOCK_ID`` marks a position that must not be
  written: a null block, or a block of what vLLM already holds (before ``skip_first_n_tokens``).

The rules (see docs/connector.md for what each prevents):

1. :func:`admitted_range` - a retrieve covers only what the scheduler admitted, rounded up to the chunk that holds
   the last admitted token and capped at the lookup hit; the locks of every other hit chunk are released at once.
2. :func:`plan_retrieve` - per group, null destinations become ``SKIPPED_BLOCK_ID``; a group's leading skipped
   chunks are dropped, so the attention group restores the whole range while a recurrent group restores only the
   checkpoint it resumes from; a skipped destination after a real one fails the retrieve closed.
3. :func:`store_window` - a store ends before the first chunk that has the null block in any group.
4. :func:`find_coverage_gap` - no retrieve into a range some group has no blocks allocated for.

In the connector, ``update_state_after_alloc`` calls :func:`admitted_range` and frees ``release_now`` at once;
``build_connector_meta`` calls :func:`plan_retrieve` for a request about to load (a ``fail_closed`` plan frees its
``locks_to_release`` and reports the load failed, so vLLM recomputes) and :func:`store_window` for every store.

A worker carries a plan out group by group: :attr:`RetrievePlan.segments` splits the range where the set of
writing groups changes. The unmodified LMCache 0.5.6 server takes one range and one block list per group and
writes a fixed, window-shaped part of it; ``lmcache_r3.mp.stock_fit`` says whether that part is exactly the plan's
real destinations, and gives the block lists to send when it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Literal

import msgspec

from lmcache_r3.artifacts import TokenRange

SKIPPED_BLOCK_ID = -1
"""Marks a destination that must not be written: a null block, or a block vLLM already holds."""

NEVER_ADMITTED = -1
"""Admitted-token count of a request the scheduler never reported an admission for (stock behaviour applies)."""

VLLM_NULL_BLOCK_ID = 0
"""vLLM's null placeholder block id, the default ``null_block_id``."""

RetrieveFailure = Literal["uncovered", "interior_skip", "no_real_destination"]
StoreStop = Literal["", "null_block", "unallocated"]


# -- chunk arithmetic -------------------------------------------------------------------------------------------
def floor_to_chunk(num_tokens: int, chunk_size: int) -> int:
    """Round a token count down to a chunk boundary: ``floor_to_chunk(48, 32) == 32``."""
    return num_tokens // chunk_size * chunk_size


def ceil_to_chunk(num_tokens: int, chunk_size: int) -> int:
    """Round a token count up to a chunk boundary: ``ceil_to_chunk(40, 32) == 64``, ``ceil_to_chunk(64, 32) == 64``."""
    return -(-num_tokens // chunk_size) * chunk_size


def block_index_range(tokens: TokenRange, tokens_per_block: int) -> range:
    """Indices of a group's blocks that hold any token of ``tokens``.

    Example: with 64-token blocks, ``[0, 256)`` is blocks ``0..3``; with 12,288-token blocks (several chunks per
    block), ``[3072, 4608)`` is block ``0`` alone.

    Args:
        tokens: The token range; may be empty.
        tokens_per_block: The group's tokens per block, positive.

    Returns:
        ``range(first_block, end_block)``, empty for an empty range.
    """
    if tokens.end <= tokens.start:
        return range(0)
    return range(tokens.start // tokens_per_block, -(-tokens.end // tokens_per_block))


def block_ids_for_range(
    tokens: TokenRange,
    allocated_block_ids: Sequence[Sequence[int]],
    group_tokens_per_block: Sequence[int],
) -> tuple[tuple[int, ...], ...]:
    """Slice each group's block ids for a token range.

    Example: over the same 256 tokens a 32-token group gets 8 ids and a 64-token group 4, while a 12,288-token
    group gets the 1 block that holds them.

    Args:
        tokens: The token range.
        allocated_block_ids: One block-id list per engine group, from token 0 (the tracker's
            ``allocated_block_ids[g]``; a missing group is an empty list).
        group_tokens_per_block: Tokens per block of each group; ``0`` for a scratch group.

    Returns:
        One tuple of block ids per group; a scratch group's is empty.

    Raises:
        ValueError: One block-id list per group is missing, or a group has fewer blocks than the range needs (see
            :func:`find_coverage_gap`).
    """
    _check_group_count(allocated_block_ids, group_tokens_per_block)
    sliced: list[tuple[int, ...]] = []
    for group, (block_ids, tokens_per_block) in enumerate(
        zip(allocated_block_ids, group_tokens_per_block, strict=True)
    ):
        if tokens_per_block == 0:
            sliced.append(())
            continue
        indices = block_index_range(tokens, tokens_per_block)
        if indices and indices.stop > len(block_ids):
            raise ValueError(
                f"group {group} holds {len(block_ids)} block(s) of {tokens_per_block} tokens, "
                f"too few for tokens {tokens}"
            )
        sliced.append(tuple(block_ids[indices.start : indices.stop]))
    return tuple(sliced)


# -- rule 1: the admitted range ---------------------------------------------------------------------------------
class AdmittedRange(msgspec.Struct, frozen=True):
    """What a request retrieves after the scheduler's admission, and which lookup locks to free right away."""

    retrieve: TokenRange | None
    """Chunk-aligned range of the RETRIEVE, ``[floor_to_chunk(vllm_hit), admitted_end)``; None: no retrieve."""
    skip_first_n_tokens: int
    """Tokens at the start of ``retrieve`` that vLLM already holds and the retrieve must not write."""
    release_now: tuple[TokenRange, ...]
    """Chunk-aligned ranges whose lookup locks no retrieve will consume; free them at admission."""
    exact_admitted_end: int | None = None
    """The token after the last admitted one, before rounding up to the chunk (capped at the hit); None without a
    retrieve. When it is below ``retrieve.end`` the retrieve restores recurrent checkpoints of a later position
    than the one vLLM resumes from, which only an attention-only model can accept."""

    @property
    def admitted_end(self) -> int | None:
        """The token after the last one the retrieve restores, or None when there is no retrieve."""
        return None if self.retrieve is None else self.retrieve.end


def admitted_range(
    *,
    chunk_size: int,
    num_vllm_hit_tokens: int,
    num_lookup_hit_tokens: int,
    num_admitted_external_tokens: int | None,
    num_computed_tokens: int | None = None,
) -> AdmittedRange:
    """Bound a retrieve by the external tokens the scheduler admitted, and say which lookup locks to free now.

    ``admitted_end = ceil_to_chunk(num_computed_tokens + admitted)``, clamped to ``[vllm_hit, lookup_hit]``: the
    chunk holding the last admitted token is retrieved whole, nothing past the lookup hit is. The retrieve starts
    at the chunk holding ``vllm_hit`` and skips the tokens vLLM holds, as LMCache 0.5.6 does. Every locked chunk of
    ``[0, lookup_hit)`` is released exactly once: by the retrieve when inside it, otherwise in ``release_now``.

    Example (``chunk_size=32``, lookup hit 128, 4 chunks locked): admitted 40 after a local hit of 0 retrieves
    ``[0, 64)`` and frees ``[64, 128)`` at once; admitted 0 retrieves nothing and frees ``[0, 128)``; never
    admitted retrieves ``[0, 128)``. A local hit of 48 with 80 admitted retrieves ``[32, 128)`` skipping 16
    tokens and frees ``[0, 32)``.

    Args:
        chunk_size: LMCache tokens per chunk.
        num_vllm_hit_tokens: vLLM's local hit, rounded down to a block boundary of every group (the tracker's
            ``num_vllm_hit_tokens``).
        num_lookup_hit_tokens: LMCache's lookup hit, a multiple of ``chunk_size``.
        num_admitted_external_tokens: ``num_external_tokens`` of ``update_state_after_alloc``; None or
            ``NEVER_ADMITTED`` when no admission was recorded (retrieve the whole hit, as LMCache 0.5.6 does).
        num_computed_tokens: The local count the admitted tokens follow (the ``num_computed_tokens`` of
            ``get_num_new_matched_tokens``), when it is larger than the rounded ``num_vllm_hit_tokens``.

    Returns:
        The retrieve range, if any, and the lock ranges to free now.

    Raises:
        ValueError: A count is negative or not an int, the lookup hit is not a whole number of chunks, the
            admitted count is below ``NEVER_ADMITTED``, or ``num_computed_tokens < num_vllm_hit_tokens``.
    """
    _require_positive("chunk_size", chunk_size)
    vllm_hit = _require_count("num_vllm_hit_tokens", num_vllm_hit_tokens)
    lookup_hit = _require_count("num_lookup_hit_tokens", num_lookup_hit_tokens)
    if lookup_hit % chunk_size:
        raise ValueError(
            f"num_lookup_hit_tokens {lookup_hit} is not a multiple of chunk_size {chunk_size}; "
            "pass the hit LMCache's lookup returned"
        )
    admitted = NEVER_ADMITTED if num_admitted_external_tokens is None else num_admitted_external_tokens
    if type(admitted) is not int or admitted < NEVER_ADMITTED:
        raise ValueError(f"num_admitted_external_tokens must be >= 0, None or NEVER_ADMITTED, got {admitted!r}")
    base = vllm_hit if num_computed_tokens is None else _require_count("num_computed_tokens", num_computed_tokens)
    if base < vllm_hit:
        raise ValueError(
            f"num_computed_tokens {base} is below num_vllm_hit_tokens {vllm_hit}; the rounded hit never exceeds "
            "the count it was rounded from"
        )

    if admitted == NEVER_ADMITTED:
        end = exact_end = lookup_hit
    elif admitted == 0:
        end = exact_end = vllm_hit  # nothing admitted: no retrieve
    else:
        end = min(lookup_hit, max(vllm_hit, ceil_to_chunk(base + admitted, chunk_size)))
        exact_end = min(lookup_hit, base + admitted)
    if end <= vllm_hit:
        release_all = (TokenRange(0, lookup_hit),) if lookup_hit else ()
        return AdmittedRange(retrieve=None, skip_first_n_tokens=0, release_now=release_all)

    start = floor_to_chunk(vllm_hit, chunk_size)
    release = [r for r in (TokenRange(0, start), TokenRange(end, lookup_hit)) if r.end > r.start]
    return AdmittedRange(
        retrieve=TokenRange(start, end),
        skip_first_n_tokens=vllm_hit - start,
        release_now=tuple(release),
        exact_admitted_end=exact_end,
    )


# -- rule 4: the coverage guard ---------------------------------------------------------------------------------
class CoverageGap(msgspec.Struct, frozen=True):
    """A group whose allocated blocks end before the range a retrieve needs."""

    group: int
    """The engine group."""
    tokens_per_block: int
    """Its tokens per block."""
    covered_tokens: int
    """Tokens its allocated blocks hold, ``[0, covered_tokens)``."""
    needed: TokenRange
    """The range the retrieve needs."""

    @property
    def reason(self) -> str:
        """One line naming the group, the numbers, and what happens instead."""
        return (
            f"group {self.group} has blocks for tokens [0, {self.covered_tokens}) ({self.tokens_per_block} per "
            f"block) but the retrieve needs {self.needed}; writing past its blocks is refused and the tokens are "
            "recomputed"
        )


def find_coverage_gap(
    tokens: TokenRange,
    allocated_block_ids: Sequence[Sequence[int]],
    group_tokens_per_block: Sequence[int],
) -> CoverageGap | None:
    """Find the first group whose allocated blocks do not hold every token of a retrieve range.

    Example: a request admitted for 64 of a 128-token hit has two 32-token blocks; a retrieve of ``[0, 128)``
    (what LMCache 0.5.6 asks for when the admission is ignored) has a gap in every group, ``[0, 64)`` has none.

    Args:
        tokens: The retrieve range.
        allocated_block_ids: One block-id list per engine group, from token 0.
        group_tokens_per_block: Tokens per block of each group; scratch groups (``0``) are never short.

    Returns:
        The first short group, or None when every group covers ``tokens``.

    Raises:
        ValueError: One block-id list per group is missing.
    """
    _check_group_count(allocated_block_ids, group_tokens_per_block)
    for group, (block_ids, tokens_per_block) in enumerate(
        zip(allocated_block_ids, group_tokens_per_block, strict=True)
    ):
        if tokens_per_block and len(block_ids) * tokens_per_block < tokens.end:
            return CoverageGap(group, tokens_per_block, len(block_ids) * tokens_per_block, tokens)
    return None


# -- rule 2: the null-block projection --------------------------------------------------------------------------
class GroupRetrieve(msgspec.Struct, frozen=True):
    """One engine group's part of a retrieve."""

    group: int
    """The engine group."""
    tokens_per_block: int
    """Its tokens per block; ``0`` for a scratch group, which writes nothing."""
    skipped_prefix_chunks: int
    """Leading chunks of the range in which this group writes nothing (dropped from ``block_ids``)."""
    first_write_token: int
    """First token this group writes; later than the start of its first kept chunk when that chunk begins with
    skipped blocks (recurrent blocks smaller than a chunk)."""
    block_ids: tuple[int, ...]
    """Blocks holding the kept chunks ``[start + skipped_prefix_chunks * chunk_size, end)``: ``SKIPPED_BLOCK_ID``
    only before the first real id, and only inside the first kept chunk; never the null block."""

    @property
    def is_scratch(self) -> bool:
        return self.tokens_per_block == 0


class RetrieveSegment(msgspec.Struct, frozen=True):
    """A chunk-aligned part of a retrieve in which each group writes from a fixed token to the segment's end."""

    tokens: TokenRange
    """The segment."""
    write_from: tuple[int | None, ...]
    """Per group, the first token it writes in the segment (it writes ``[write_from, tokens.end)``); None when it
    writes nothing here."""


class RetrievePlan(msgspec.Struct, frozen=True):
    """A retrieve projected onto a request's block tables: what each group writes, or why nothing is retrieved."""

    kind: Literal["retrieve", "fail_closed"]
    """``retrieve``: issue it; ``fail_closed``: retrieve nothing, free ``locks_to_release``, let vLLM recompute."""
    tokens: TokenRange
    """The chunk-aligned retrieve range (as planned by :func:`admitted_range`)."""
    chunk_size: int
    """LMCache tokens per chunk."""
    skip_first_n_tokens: int = 0
    """Tokens at the start of ``tokens`` that vLLM already holds."""
    groups: tuple[GroupRetrieve, ...] = ()
    """One entry per engine group when ``kind == "retrieve"``; empty otherwise."""
    failure: RetrieveFailure | None = None
    """Why the plan failed closed: ``uncovered`` (coverage guard), ``interior_skip`` (a skipped destination
    after a real one), ``no_real_destination`` (a group has nothing to restore into)."""
    reason: str = ""
    """One line with the group and the numbers, for the log."""

    @property
    def locks_to_release(self) -> tuple[TokenRange, ...]:
        """Lock ranges the connector frees because no retrieve will consume them."""
        return (self.tokens,) if self.kind == "fail_closed" else ()

    @property
    def common_start_token(self) -> int:
        """First token from which every group writes every token: ``[common_start_token, end)`` has only real
        destinations, so one RETRIEVE of ``[floor_to_chunk(common_start_token), end)`` skipping
        ``common_start_token % chunk_size`` tokens is safe on any server."""
        writers = [g.first_write_token for g in self.groups if not g.is_scratch]
        return max(writers) if writers else self.tokens.end

    @property
    def segments(self) -> tuple[RetrieveSegment, ...]:
        """The retrieve split where the set of writing groups changes.

        A server that writes every group of every chunk it reads cannot leave a group's leading chunks alone, so
        a worker that restores group by group issues one transfer per segment. Groups only ever start writing
        (skips are leading), so each group writes ``[write_from, segment end)`` in every segment from its first
        kept chunk on. For the seed's case (``[0, 4608)``, chunk 1,536, recurrent ``[0, 0, c2]``) the segments
        are ``[0, 3072)`` written by the attention group alone and ``[3072, 4608)`` written by every group.
        """
        if self.kind != "retrieve":
            return ()
        cuts = {self.tokens.start, self.tokens.end}
        cuts.update(
            self.tokens.start + g.skipped_prefix_chunks * self.chunk_size for g in self.groups if not g.is_scratch
        )
        bounds = sorted(cuts)
        return tuple(
            RetrieveSegment(
                TokenRange(lo, hi),
                tuple(
                    None if g.is_scratch or g.first_write_token >= hi else max(lo, g.first_write_token)
                    for g in self.groups
                ),
            )
            for lo, hi in pairwise(bounds)
        )


def plan_retrieve(
    tokens: TokenRange,
    allocated_block_ids: Sequence[Sequence[int]],
    group_tokens_per_block: Sequence[int],
    chunk_size: int,
    *,
    skip_first_n_tokens: int = 0,
    null_block_id: int = VLLM_NULL_BLOCK_ID,
) -> RetrievePlan:
    """Project a retrieve onto a request's block tables so that the null block is never written.

    Per group, the destinations are the blocks holding ``[start + skip_first_n_tokens, end)``. A null one becomes
    ``SKIPPED_BLOCK_ID``. The group's leading skipped destinations are dropped (whole chunks from ``block_ids``,
    the rest before ``first_write_token``); a skipped destination after a real one, or a group with no real
    destination, fails the plan closed, as does a group whose blocks do not cover the range.

    Example (the seed's case): chunk 1,536, an attention group of one 12,288-token block ``[7]`` and a recurrent
    group of 1,536-token blocks ``[0, 0, 21, 22]``, retrieving ``[0, 4608)``: the attention group writes all three
    chunks into block 7, the recurrent group skips two chunks and writes only chunk 2 into block 21 (the
    checkpoint it resumes from). With ``[21, 0, 22]`` the null block follows a real one and the plan fails closed.

    Args:
        tokens: The chunk-aligned, non-empty retrieve range (``AdmittedRange.retrieve``).
        allocated_block_ids: One block-id list per engine group, from token 0.
        group_tokens_per_block: Tokens per block of each group; ``0`` for a scratch group.
        chunk_size: LMCache tokens per chunk.
        skip_first_n_tokens: Tokens at the start of ``tokens`` that vLLM holds (``AdmittedRange``).
        null_block_id: The engine's null block id.

    Returns:
        A ``retrieve`` plan, or a ``fail_closed`` plan with the reason.

    Raises:
        ValueError: Inconsistent inputs: geometry (see the module docstring), a range not on chunk boundaries or
            empty, ``skip_first_n_tokens`` outside the range, one list per group missing, a negative block id.
    """
    _check_geometry(group_tokens_per_block, chunk_size)
    _check_chunk_range("tokens", tokens, chunk_size)
    if tokens.end == tokens.start:
        raise ValueError(f"retrieve range {tokens} is empty; plan a retrieve only when AdmittedRange.retrieve is set")
    if not 0 <= skip_first_n_tokens < tokens.num_tokens:
        raise ValueError(f"skip_first_n_tokens {skip_first_n_tokens} must lie inside the retrieve range {tokens}")
    _check_group_count(allocated_block_ids, group_tokens_per_block)

    def fail(failure: RetrieveFailure, reason: str) -> RetrievePlan:
        return RetrievePlan(
            "fail_closed", tokens, chunk_size, skip_first_n_tokens=skip_first_n_tokens, failure=failure, reason=reason
        )

    gap = find_coverage_gap(tokens, allocated_block_ids, group_tokens_per_block)
    if gap is not None:
        return fail("uncovered", gap.reason)

    write_start = tokens.start + skip_first_n_tokens
    groups: list[GroupRetrieve] = []
    for group, (block_ids, tokens_per_block) in enumerate(
        zip(allocated_block_ids, group_tokens_per_block, strict=True)
    ):
        if tokens_per_block == 0:
            groups.append(GroupRetrieve(group, 0, tokens.num_tokens // chunk_size, tokens.end, ()))
            continue
        indices = block_index_range(tokens, tokens_per_block)
        _reject_negative(group, block_ids[indices.start : indices.stop])
        first_destination = write_start // tokens_per_block
        projected = [
            SKIPPED_BLOCK_ID if index < first_destination or block_ids[index] == null_block_id else block_ids[index]
            for index in indices
        ]
        first_real = next((i for i, block in enumerate(projected) if block != SKIPPED_BLOCK_ID), None)
        if first_real is None:
            return fail(
                "no_real_destination",
                f"group {group} has only the null block for tokens [{write_start}, {tokens.end}); a retrieve "
                "would leave it without state, so the tokens are recomputed",
            )
        interior = next((i for i in range(first_real, len(projected)) if projected[i] == SKIPPED_BLOCK_ID), None)
        if interior is not None:
            block_start = (indices.start + interior) * tokens_per_block
            return fail(
                "interior_skip",
                f"group {group} has the null block for tokens [{block_start}, {block_start + tokens_per_block}) "
                f"after a real block in the retrieve {tokens}; only leading null blocks can be skipped, so the "
                "tokens are recomputed",
            )
        first_write_token = max(write_start, (indices.start + first_real) * tokens_per_block)
        skipped_chunks = (first_write_token - tokens.start) // chunk_size
        first_kept_block = (tokens.start + skipped_chunks * chunk_size) // tokens_per_block - indices.start
        groups.append(
            GroupRetrieve(
                group, tokens_per_block, skipped_chunks, first_write_token, tuple(projected[first_kept_block:])
            )
        )
    return RetrievePlan("retrieve", tokens, chunk_size, skip_first_n_tokens=skip_first_n_tokens, groups=tuple(groups))


# -- rule 3: the store window -----------------------------------------------------------------------------------
class StoreWindow(msgspec.Struct, frozen=True):
    """The part of a store candidate that may be published, and the blocks it reads."""

    tokens: TokenRange
    """Chunk-aligned prefix of the candidate; empty when its first chunk cannot be stored."""
    block_ids: tuple[tuple[int, ...], ...]
    """Per group, the blocks holding ``tokens`` (never the null block); empty tuples for an empty window."""
    stop: StoreStop = ""
    """Why the window ends before the candidate does: ``null_block`` or ``unallocated``; ``""`` when it does not."""
    stop_group: int | None = None
    """The group that ended it."""

    @property
    def stopped_at(self) -> int | None:
        """The first token not stored because of ``stop``, or None when the whole candidate is stored."""
        return self.tokens.end if self.stop else None


def store_window(
    candidate: TokenRange,
    allocated_block_ids: Sequence[Sequence[int]],
    group_tokens_per_block: Sequence[int],
    chunk_size: int,
    *,
    null_block_id: int = VLLM_NULL_BLOCK_ID,
) -> StoreWindow:
    """End a store before the first chunk whose blocks include the null block in any group.

    Objects are a contiguous prefix, so nothing past that chunk could ever be found, and storing the chunk itself
    would publish the null page as cached content. A chunk some group has no block for ends the window as well.

    Example (chunk 32, two 32-token groups): candidate ``[0, 128)`` with tables ``[1, 2, 3, 4]`` and
    ``[9, 10, 0, 12]`` stores ``[0, 64)``; with ``[0, 10, 11, 12]`` it stores nothing. A resumed request
    ``[0, 0, c2, w]`` whose candidate starts at 96 stores chunk 3 from ``w``: chunks before the candidate do not
    matter.

    Args:
        candidate: Chunk-aligned range LMCache 0.5.6 would store (``[num_stored_tokens, end)`` of
            ``GetStoreMetadata``).
        allocated_block_ids: One block-id list per engine group, from token 0.
        group_tokens_per_block: Tokens per block of each group; scratch groups (``0``) are ignored.
        chunk_size: LMCache tokens per chunk.
        null_block_id: The engine's null block id.

    Returns:
        The storable prefix of ``candidate`` and its blocks.

    Raises:
        ValueError: Inconsistent geometry, a candidate not on chunk boundaries, one list per group missing, or a
            negative block id.
    """
    _check_geometry(group_tokens_per_block, chunk_size)
    _check_chunk_range("candidate", candidate, chunk_size)
    _check_group_count(allocated_block_ids, group_tokens_per_block)
    end, stop, stop_group = candidate.end, "", None
    for chunk_start in range(candidate.start, candidate.end, chunk_size):
        chunk = TokenRange(chunk_start, chunk_start + chunk_size)
        for group, (block_ids, tokens_per_block) in enumerate(
            zip(allocated_block_ids, group_tokens_per_block, strict=True)
        ):
            if tokens_per_block == 0:
                continue
            indices = block_index_range(chunk, tokens_per_block)
            if indices.stop > len(block_ids):
                stop, stop_group = "unallocated", group
                break
            _reject_negative(group, block_ids[indices.start : indices.stop])
            if null_block_id in block_ids[indices.start : indices.stop]:
                stop, stop_group = "null_block", group
                break
        if stop:
            end = chunk_start
            break
    window = TokenRange(candidate.start, end)
    return StoreWindow(
        window, block_ids_for_range(window, allocated_block_ids, group_tokens_per_block), stop, stop_group
    )


# -- input checks -----------------------------------------------------------------------------------------------
def _require_positive(name: str, value: object) -> int:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _require_count(name: str, value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative int token count, got {value!r}")
    return value


def _check_geometry(group_tokens_per_block: Sequence[int], chunk_size: int) -> None:
    _require_positive("chunk_size", chunk_size)
    if not any(group_tokens_per_block):
        raise ValueError(f"group_tokens_per_block {list(group_tokens_per_block)} has no cacheable group")
    for group, tokens_per_block in enumerate(group_tokens_per_block):
        if type(tokens_per_block) is not int or tokens_per_block < 0:
            raise ValueError(f"group {group} tokens_per_block must be a non-negative int, got {tokens_per_block!r}")
        if tokens_per_block and chunk_size % tokens_per_block and tokens_per_block % chunk_size:
            raise ValueError(
                f"group {group} has {tokens_per_block}-token blocks and chunks have {chunk_size} tokens; one must "
                "divide the other"
            )


def _check_chunk_range(name: str, tokens: TokenRange, chunk_size: int) -> None:
    if tokens.start < 0 or tokens.end < tokens.start or tokens.start % chunk_size or tokens.end % chunk_size:
        raise ValueError(f"{name} {tokens} must be an ordered range on chunk boundaries (chunk_size {chunk_size})")


def _check_group_count(allocated_block_ids: Sequence[Sequence[int]], group_tokens_per_block: Sequence[int]) -> None:
    if len(allocated_block_ids) != len(group_tokens_per_block):
        raise ValueError(
            f"need one block-id list per group ({len(group_tokens_per_block)}), got {len(allocated_block_ids)}; "
            "pass [tracker.allocated_block_ids.get(g, []) for g in range(num_groups)]"
        )


def _reject_negative(group: int, block_ids: Sequence[int]) -> None:
    if any(block < 0 for block in block_ids):
        raise ValueError(f"group {group} block ids {list(block_ids)} include a negative id; engine block ids are >= 0")
