"""Carrying a retrieve plan out with one RETRIEVE of the unmodified LMCache 0.5.6 server.

The stock server takes one token range and one block-id list per KV group, and writes, per group, a fixed part of
it that depends on the group's window and on ``--separate-object-groups`` (:func:`stock_write_tokens`). It cannot
start one group later than another. :func:`fit_stock_retrieve` says whether that part is exactly a plan's real
destinations (so the null block is never written) and whether the objects it reads were locked by the lookup;
when both hold, it gives the block lists to send. Pure functions, like :mod:`lmcache_r3.mp.planning`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from lmcache_r3.artifacts import TokenRange
from lmcache_r3.mp.planning import SKIPPED_BLOCK_ID, RetrievePlan, block_index_range


class StockRetrieveFit(msgspec.Struct, frozen=True):
    """Whether one RETRIEVE of the stock LMCache 0.5.6 server carries out a retrieve plan exactly."""

    ok: bool
    """True: send one RETRIEVE of ``plan.tokens`` with ``block_ids`` and ``plan.skip_first_n_tokens``."""
    reason: str
    """Why not, with the group and the numbers; empty when ``ok``."""
    block_ids: tuple[tuple[int, ...], ...] = ()
    """Per group, one id per block of the whole range (the server's layout); positions the server does not write
    hold the group's first real destination instead of the null block. Empty unless ``ok``."""


def stock_write_tokens(sw_size_tokens: int, chunk_size: int, *, separate_object_groups: bool) -> tuple[int, int]:
    """How the stock LMCache 0.5.6 server writes one group on RETRIEVE: ``(trailing_chunks, tokens_per_chunk)``.

    The server writes the last ``trailing_chunks`` chunks of the range (``-1``: all) and in each of them the last
    ``tokens_per_chunk`` tokens. A group's window ``sw_size_tokens`` is the sliding window, or the block size of a
    recurrent group (``-1`` for full attention). A window smaller than a chunk keeps only its tail of every chunk;
    only ``--separate-object-groups`` limits the chunks, to ``ceil(window / chunk_size)``.

    Example (chunk 64): a recurrent group of 16-token blocks writes the last 16 tokens of every chunk by default,
    ``(-1, 16)``, and the last 16 tokens of the range with ``--separate-object-groups``, ``(1, 16)``.
    """
    if sw_size_tokens < 0:
        return -1, chunk_size
    tail = min(sw_size_tokens, chunk_size)
    return (-(-sw_size_tokens // chunk_size) if separate_object_groups else -1), tail


def fit_stock_retrieve(
    plan: RetrievePlan,
    *,
    group_sw_size_tokens: Sequence[int],
    separate_object_groups: bool,
    num_lookup_hit_tokens: int,
) -> StockRetrieveFit:
    """Check that one stock RETRIEVE writes only a plan's real destinations and reads only locked objects.

    The stock server takes one block-id list per group for the whole range and writes what
    :func:`stock_write_tokens` says, after ``skip_first_n_tokens``; it cannot start a group later. So the plan
    fits when every group's written tokens start at or after its ``first_write_token``; real destinations before a
    windowed group's written tail (older recurrent checkpoints) keep their content, as in stock. With windowed object
    groups the server also reads the trailing chunks of the *retrieve* while the lookup locked the trailing chunks
    of the *hit*; a partial admission that ends before the hit would read objects nobody locked, so it does not fit.

    Example (chunk 32, attention and recurrent groups of 32-token blocks, recurrent ``[0, 0, 0, 10]``, retrieve
    and hit ``[0, 128)``): by default the server writes all four recurrent chunks, three of them into the null
    block, so it does not fit; with ``--separate-object-groups`` it writes only chunk 3 into block 10, and the
    fit sends recurrent ids ``[10, 10, 10, 10]``.

    Args:
        plan: A ``retrieve`` plan.
        group_sw_size_tokens: Per group, the window LMCache registers for it (sliding window, recurrent block
            size, ``-1`` for full attention); ignored for scratch groups.
        separate_object_groups: Whether the server runs with ``--separate-object-groups``.
        num_lookup_hit_tokens: The lookup hit whose locks the retrieve consumes.

    Returns:
        The fit, with the block-id lists to send when it is ok.

    Raises:
        ValueError: The plan is not a ``retrieve`` plan, or one window per group is missing.
    """
    if plan.kind != "retrieve":
        raise ValueError(f"only a retrieve plan can be sent, got a {plan.kind} plan ({plan.reason})")
    if len(group_sw_size_tokens) != len(plan.groups):
        raise ValueError(f"need one window per group ({len(plan.groups)}), got {len(group_sw_size_tokens)}")
    chunk_size, tokens = plan.chunk_size, plan.tokens
    num_chunks = tokens.num_tokens // chunk_size
    hit_chunks = num_lookup_hit_tokens // chunk_size
    wire: list[tuple[int, ...]] = []
    for group, sw_size_tokens in zip(plan.groups, group_sw_size_tokens, strict=True):
        if group.is_scratch:
            wire.append(())
            continue
        if chunk_size % group.tokens_per_block:
            return StockRetrieveFit(
                False,
                f"group {group.group} has {group.tokens_per_block}-token blocks, larger than chunk {chunk_size}; "
                "LMCache 0.5.6 needs the chunk size to be a multiple of every group's block size",
            )
        trailing_chunks, tail = stock_write_tokens(
            sw_size_tokens, chunk_size, separate_object_groups=separate_object_groups
        )
        written_chunks = num_chunks if trailing_chunks < 0 else min(num_chunks, trailing_chunks)
        first_written_chunk = num_chunks - written_chunks
        first_written = max(
            tokens.start + plan.skip_first_n_tokens,
            tokens.start + (first_written_chunk + 1) * chunk_size - tail,
        )
        if first_written < group.first_write_token:
            return StockRetrieveFit(
                False,
                f"group {group.group}: the server writes from token {first_written} but the first real "
                f"destination is at {group.first_write_token}; it would write the null block",
            )
        if trailing_chunks >= 0:
            read = TokenRange(tokens.start // chunk_size + first_written_chunk, tokens.end // chunk_size)
            locked_from = max(0, hit_chunks - trailing_chunks)
            if read.start < locked_from or read.end > hit_chunks:
                return StockRetrieveFit(
                    False,
                    f"group {group.group}: the server reads chunks {read} but the lookup locked chunks "
                    f"[{locked_from}, {hit_chunks}) of its window; a retrieve ending before the hit reads "
                    "unlocked objects",
                )
        filler = next(block for block in group.block_ids if block != SKIPPED_BLOCK_ID)
        kept = tuple(filler if block == SKIPPED_BLOCK_ID else block for block in group.block_ids)
        dropped = len(block_index_range(tokens, group.tokens_per_block)) - len(kept)
        wire.append((filler,) * dropped + kept)
    return StockRetrieveFit(True, "", tuple(wire))
