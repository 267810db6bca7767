"""Connector planning: retrieves stop at what the scheduler admitted, the null block is never a destination or a
source, stores stop before the first null chunk, and a retrieve the blocks do not cover is refused."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lmcache_r3.artifacts import TokenRange
from lmcache_r3.mp.planning import (
    NEVER_ADMITTED,
    SKIPPED_BLOCK_ID,
    RetrieveSegment,
    admitted_range,
    block_ids_for_range,
    ceil_to_chunk,
    find_coverage_gap,
    plan_retrieve,
    store_window,
)
from lmcache_r3.mp.stock_fit import fit_stock_retrieve, stock_write_tokens

R = TokenRange
S = SKIPPED_BLOCK_ID


def spec(name: str, *values):
    """One table row; ``name`` reads as the rule the row pins down."""
    return pytest.param(*values, id=name)


# The seed's case: LMCache chunk and recurrent cadence 1,536 tokens, attention block 12,288 tokens (DCP-scaled), a
# request resumed at 4,608 of 12,288 tokens; each of two recurrent groups carries [0, 0, c2, w].
SEED_CHUNK = 1536
SEED_TOKENS_PER_BLOCK = [12288, 1536, 1536]
SEED_TABLES = [[7], [0, 0, 21, 22], [0, 0, 31, 32]]

# The stock-LMCache baseline's hybrid config: chunk 32, attention and mamba groups of 32-token blocks, 4 chunks hit.
BASELINE_TABLES = [[1, 2, 3, 4, 5], [0, 0, 0, 10, 11]]


# -- rule 1: the admitted range ---------------------------------------------------------------------------------
# fmt: off
ADMITTED_RANGE_CASES = [
    spec("never_admitted_retrieves_the_whole_hit_like_stock",
         32, 0, 128, None, None, (0, 128), 0, []),
    spec("never_admitted_as_minus_one_is_the_same",
         32, 0, 128, NEVER_ADMITTED, None, (0, 128), 0, []),
    spec("zero_admitted_retrieves_nothing_and_frees_every_lock",
         32, 0, 128, 0, None, None, 0, [(0, 128)]),
    spec("partial_admission_ends_at_the_chunk_of_the_last_admitted_token_and_frees_the_rest",
         32, 0, 128, 40, None, (0, 64), 0, [(64, 128)]),
    spec("admission_ending_on_a_chunk_boundary_is_not_rounded_up",
         32, 0, 128, 64, None, (0, 64), 0, [(64, 128)]),
    spec("full_prompt_hit_admitted_one_token_short_still_retrieves_the_hit",
         32, 0, 128, 127, None, (0, 128), 0, []),
    spec("admitted_more_than_the_hit_is_capped_at_the_hit",
         32, 0, 128, 500, None, (0, 128), 0, []),
    spec("unaligned_vllm_hit_starts_at_its_chunk_skips_local_tokens_and_frees_whole_local_chunks",
         32, 48, 128, 80, None, (32, 128), 16, [(0, 32)]),
    spec("unaligned_vllm_hit_with_partial_admission_frees_both_sides",
         32, 48, 160, 20, None, (32, 96), 16, [(0, 32), (96, 160)]),
    spec("chunks_vllm_holds_are_freed_not_retrieved",
         32, 64, 128, 64, None, (64, 128), 0, [(0, 64)]),
    spec("local_hit_covering_the_lookup_hit_frees_everything",
         32, 128, 128, 0, None, None, 0, [(0, 128)]),
    spec("never_admitted_with_a_longer_local_hit_frees_everything",
         32, 160, 128, None, None, None, 0, [(0, 128)]),
    spec("no_lookup_hit_holds_no_locks",
         32, 0, 0, 0, None, None, 0, []),
    spec("admitted_tokens_count_from_the_unrounded_local_hit",
         64, 32, 128, 30, 40, (0, 128), 32, []),
    spec("without_the_unrounded_count_the_rounded_hit_anchors_the_admission",
         64, 32, 128, 30, None, (0, 64), 32, [(64, 128)]),
    spec("seed_resume_at_4608_retrieves_three_chunks",
         1536, 0, 4608, 4608, None, (0, 4608), 0, []),
]
# fmt: on


@pytest.mark.parametrize(
    ("chunk", "vllm_hit", "lookup_hit", "admitted", "computed", "retrieve", "skip", "release_now"), ADMITTED_RANGE_CASES
)
def test_admitted_range(chunk, vllm_hit, lookup_hit, admitted, computed, retrieve, skip, release_now):
    planned = admitted_range(
        chunk_size=chunk,
        num_vllm_hit_tokens=vllm_hit,
        num_lookup_hit_tokens=lookup_hit,
        num_admitted_external_tokens=admitted,
        num_computed_tokens=computed,
    )

    assert planned.retrieve == (None if retrieve is None else R(*retrieve))
    assert planned.admitted_end == (None if retrieve is None else retrieve[1])
    assert planned.skip_first_n_tokens == skip
    assert planned.release_now == tuple(R(*r) for r in release_now)


# fmt: off
EXACT_ADMITTED_END_SAYS_WHERE_VLLM_RESUMES_CASES = [
    spec("partial_admission_restores_past_the_position_vllm_resumes_from", 40, None, 64, 40),
    spec("chunk_aligned_admission_resumes_where_the_retrieve_ends", 64, None, 64, 64),
    spec("over_admission_resumes_at_the_hit", 500, None, 128, 128),
    spec("never_admitted_resumes_at_the_hit", None, None, 128, 128),
    spec("the_unrounded_local_hit_counts", 24, 40, 64, 64),
]
# fmt: on


@pytest.mark.parametrize(
    ("admitted", "computed", "retrieve_end", "exact_end"), EXACT_ADMITTED_END_SAYS_WHERE_VLLM_RESUMES_CASES
)
def test_exact_admitted_end_says_where_vllm_resumes(admitted, computed, retrieve_end, exact_end):
    planned = admitted_range(
        chunk_size=32,
        num_vllm_hit_tokens=0,
        num_lookup_hit_tokens=128,
        num_admitted_external_tokens=admitted,
        num_computed_tokens=computed,
    )

    assert (planned.retrieve.end, planned.exact_admitted_end) == (retrieve_end, exact_end)


# fmt: off
ADMITTED_RANGE_REFUSES_INCONSISTENT_COUNTS_CASES = [
    spec("lookup_hit_off_a_chunk_boundary", {"num_lookup_hit_tokens": 100}, "not a multiple of chunk_size 32"),
    spec("negative_local_hit", {"num_vllm_hit_tokens": -1}, "num_vllm_hit_tokens must be a non-negative"),
    spec("admitted_below_never_admitted", {"num_admitted_external_tokens": -2}, "None or NEVER_ADMITTED"),
    spec("zero_chunk_size", {"chunk_size": 0}, "chunk_size must be a positive int"),
    spec("unrounded_hit_below_the_rounded_one", {"num_vllm_hit_tokens": 64, "num_computed_tokens": 32},
         "below num_vllm_hit_tokens 64"),
]
# fmt: on


@pytest.mark.parametrize(("change", "message_part"), ADMITTED_RANGE_REFUSES_INCONSISTENT_COUNTS_CASES)
def test_admitted_range_refuses_inconsistent_counts(change, message_part):
    args = {"chunk_size": 32, "num_vllm_hit_tokens": 0, "num_lookup_hit_tokens": 128, "num_admitted_external_tokens": 1}

    with pytest.raises(ValueError, match=message_part):
        admitted_range(**(args | change))


# -- rule 2: the null-block projection --------------------------------------------------------------------------
def per_group(plan):
    return [(g.skipped_prefix_chunks, g.first_write_token, list(g.block_ids)) for g in plan.groups]


# fmt: off
RETRIEVE_PROJECTION_CASES = [
    spec("seed_resume_restores_attention_whole_and_each_recurrent_group_only_its_checkpoint",
         SEED_CHUNK, SEED_TOKENS_PER_BLOCK, SEED_TABLES, (0, 4608), 0,
         [(0, 0, [7]), (2, 3072, [21]), (2, 3072, [31])]),
    spec("recurrent_group_drops_its_leading_null_chunks",
         32, [32, 32], BASELINE_TABLES, (0, 128), 0,
         [(0, 0, [1, 2, 3, 4]), (3, 96, [10])]),
    spec("groups_of_32_and_64_token_blocks_skip_inside_the_first_kept_chunk",
         128, [32, 64], [[1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 40]], (0, 256), 0,
         [(0, 0, [1, 2, 3, 4, 5, 6, 7, 8]), (1, 192, [S, 40])]),
    spec("blocks_vllm_already_holds_are_never_destinations",
         64, [32, 32], [[1, 2, 3, 4], [0, 11, 12, 13]], (0, 128), 32,
         [(0, 32, [S, 2, 3, 4]), (0, 32, [S, 11, 12, 13])]),
    spec("a_local_checkpoint_before_the_nulls_is_not_an_interior_skip",
         64, [32, 32], [[1, 2, 3, 4], [10, 0, 0, 13]], (0, 128), 32,
         [(0, 32, [S, 2, 3, 4]), (1, 96, [S, 13])]),
    spec("a_retrieve_after_a_local_hit_reads_only_its_own_blocks",
         32, [32, 32], [[1, 2, 3, 4], [0, 0, 12, 13]], (64, 128), 0,
         [(0, 64, [3, 4]), (0, 64, [12, 13])]),
    spec("scratch_groups_write_nothing",
         32, [32, 0], [[1, 2, 3], []], (32, 96), 0,
         [(0, 32, [2, 3]), (2, 96, [])]),
    spec("a_dense_table_with_a_leading_null_skips_that_chunk",
         32, [32], [[0, 1, 2]], (0, 96), 0,
         [(1, 32, [1, 2])]),
]
# fmt: on


@pytest.mark.parametrize(
    ("chunk", "tokens_per_block", "tables", "tokens", "skip", "expected"), RETRIEVE_PROJECTION_CASES
)
def test_retrieve_projection(chunk, tokens_per_block, tables, tokens, skip, expected):
    plan = plan_retrieve(R(*tokens), tables, tokens_per_block, chunk, skip_first_n_tokens=skip)

    assert plan.kind == "retrieve", plan.reason
    assert per_group(plan) == expected
    assert plan.locks_to_release == ()


def test_block_zero_is_an_ordinary_block_when_the_engine_null_block_is_another_id():
    plan = plan_retrieve(R(0, 64), [[0, 1], [99, 5]], [32, 32], 32, null_block_id=99)

    assert per_group(plan) == [(0, 0, [0, 1]), (1, 32, [5])]


# fmt: off
RETRIEVE_FAILS_CLOSED_CASES = [
    spec("a_null_after_a_kept_chunk_fails_closed",
         32, [32, 32], [[1, 2, 3], [10, 0, 12]], (0, 96), "interior_skip", "[32, 64) after a real block"),
    spec("a_null_in_the_last_chunk_after_a_kept_one_fails_closed",
         32, [32, 32], [[1, 2, 3], [0, 11, 0]], (0, 96), "interior_skip", "[64, 96) after a real block"),
    spec("seed_geometry_with_an_interior_null_fails_closed",
         SEED_CHUNK, SEED_TOKENS_PER_BLOCK, [[7], [0, 21, 0, 22], [0, 0, 31, 32]], (0, 4608),
         "interior_skip", "group 1 has the null block for tokens [3072, 4608)"),
    spec("all_groups_null_fails_closed",
         32, [32, 32], [[0, 0, 0], [0, 0, 0]], (0, 96), "no_real_destination", "group 0 has only the null"),
    spec("a_group_without_a_checkpoint_in_the_range_fails_closed",
         32, [32, 32], [[1, 2, 3], [0, 0, 0]], (0, 96), "no_real_destination", "group 1 has only the null"),
    spec("blocks_for_the_admitted_tokens_only_refuse_a_whole_hit_retrieve",
         32, [32, 32], [[1, 2], [10, 11, 12, 13]], (0, 128), "uncovered", "group 0 has blocks for tokens [0, 64)"),
    spec("coverage_is_checked_in_every_group_block_size",
         128, [32, 64], [[1, 2, 3, 4, 5, 6, 7, 8], [0, 40]], (0, 256), "uncovered", "group 1"),
]
# fmt: on


@pytest.mark.parametrize(
    ("chunk", "tokens_per_block", "tables", "tokens", "failure", "message_part"), RETRIEVE_FAILS_CLOSED_CASES
)
def test_retrieve_fails_closed(chunk, tokens_per_block, tables, tokens, failure, message_part):
    plan = plan_retrieve(R(*tokens), tables, tokens_per_block, chunk)

    assert (plan.kind, plan.failure) == ("fail_closed", failure)
    assert message_part in plan.reason
    assert plan.groups == () and plan.segments == ()
    assert plan.locks_to_release == (R(*tokens),)


# fmt: off
PLAN_RETRIEVE_REFUSES_INCONSISTENT_INPUTS_CASES = [
    spec("empty_range", {"tokens": R(0, 0)}, "is empty"),
    spec("range_off_a_chunk_boundary", {"tokens": R(16, 64)}, "on chunk boundaries"),
    spec("skip_past_the_range", {"skip_first_n_tokens": 64}, "must lie inside the retrieve range"),
    spec("block_and_chunk_sizes_that_do_not_divide", {"group_tokens_per_block": [32, 48]}, "divide the other"),
    spec("only_scratch_groups", {"group_tokens_per_block": [0, 0]}, "no cacheable group"),
    spec("a_group_list_missing", {"allocated_block_ids": [[1, 2]]}, "one block-id list per group"),
    spec("the_skipped_marker_as_an_input_id", {"allocated_block_ids": [[1, -1], [3, 4]]}, "negative id"),
]
# fmt: on


@pytest.mark.parametrize(("change", "message_part"), PLAN_RETRIEVE_REFUSES_INCONSISTENT_INPUTS_CASES)
def test_plan_retrieve_refuses_inconsistent_inputs(change, message_part):
    args = {"tokens": R(0, 64), "allocated_block_ids": [[1, 2], [3, 4]], "group_tokens_per_block": [32, 32]}
    args |= {"chunk_size": 32, "skip_first_n_tokens": 0} | change

    with pytest.raises(ValueError, match=message_part):
        plan_retrieve(**args)


def test_seed_plan_decomposes_into_an_attention_only_head_and_a_tail_every_group_writes():
    plan = plan_retrieve(R(0, 4608), SEED_TABLES, SEED_TOKENS_PER_BLOCK, SEED_CHUNK)

    assert plan.common_start_token == 3072
    assert plan.segments == (
        RetrieveSegment(R(0, 3072), (0, None, None)),
        RetrieveSegment(R(3072, 4608), (3072, 3072, 3072)),
    )


def test_a_group_starting_mid_chunk_writes_from_its_first_real_block():
    plan = plan_retrieve(R(0, 256), [[1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 40]], [32, 64], 128)

    assert plan.common_start_token == 192
    assert plan.segments == (RetrieveSegment(R(0, 128), (0, None)), RetrieveSegment(R(128, 256), (128, 192)))


def test_a_dense_plan_is_one_segment_written_after_the_local_tokens():
    plan = plan_retrieve(R(32, 128), [[1, 2, 3, 4]], [32], 32, skip_first_n_tokens=16)

    assert plan.segments == (RetrieveSegment(R(32, 128), (48,)),)
    assert plan.common_start_token == 48


# -- rule 3: the store window -----------------------------------------------------------------------------------
# fmt: off
STORE_WINDOW_CASES = [
    spec("all_real_blocks_store_the_whole_candidate",
         32, [32, 32], [[1, 2, 3, 4], [9, 10, 11, 12]], (0, 128), (0, 128), "", None,
         [[1, 2, 3, 4], [9, 10, 11, 12]]),
    spec("the_window_ends_before_the_first_chunk_with_a_null_block",
         32, [32, 32], [[1, 2, 3, 4], [9, 10, 0, 12]], (0, 128), (0, 64), "null_block", 1,
         [[1, 2], [9, 10]]),
    spec("a_null_at_chunk_zero_stores_nothing",
         32, [32, 32], [[1, 2, 3, 4], [0, 10, 11, 12]], (0, 128), (0, 0), "null_block", 1,
         [[], []]),
    spec("one_null_block_inside_a_chunk_is_enough_to_stop",
         64, [32, 32], [[1, 2, 3, 4], [9, 0, 11, 12]], (0, 128), (0, 0), "null_block", 1,
         [[], []]),
    spec("a_null_block_in_an_attention_group_stops_the_window_too",
         32, [32, 32], [[0, 2, 3, 4], [9, 10, 11, 12]], (0, 128), (0, 0), "null_block", 0,
         [[], []]),
    spec("groups_of_32_and_64_token_blocks_stop_at_the_chunk_of_the_null",
         128, [32, 64], [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 0, 12]], (0, 256), (0, 128), "null_block", 1,
         [[1, 2, 3, 4], [9, 10]]),
    spec("the_window_ends_where_a_group_has_no_block",
         32, [32, 32], [[1, 2, 3, 4], [9, 10]], (0, 128), (0, 64), "unallocated", 1,
         [[1, 2], [9, 10]]),
    spec("nulls_before_the_candidate_do_not_matter",
         32, [32, 32], [[1, 2, 3, 4], [0, 0, 11, 12]], (64, 128), (64, 128), "", None,
         [[3, 4], [11, 12]]),
    spec("seed_resumed_request_stores_its_next_chunk_from_w",
         SEED_CHUNK, SEED_TOKENS_PER_BLOCK, SEED_TABLES, (4608, 6144), (4608, 6144), "", None,
         [[7], [22], [32]]),
    spec("seed_tables_never_publish_their_null_chunks",
         SEED_CHUNK, SEED_TOKENS_PER_BLOCK, SEED_TABLES, (0, 6144), (0, 0), "null_block", 1,
         [[], [], []]),
    spec("scratch_groups_do_not_limit_the_window",
         32, [32, 0], [[1, 2], []], (0, 64), (0, 64), "", None,
         [[1, 2], []]),
    spec("an_empty_candidate_stores_nothing",
         32, [32], [[1, 2]], (64, 64), (64, 64), "", None,
         [[]]),
]
# fmt: on


@pytest.mark.parametrize(
    ("chunk", "tokens_per_block", "tables", "candidate", "window", "stop", "stop_group", "block_ids"),
    STORE_WINDOW_CASES,
)
def test_store_window(chunk, tokens_per_block, tables, candidate, window, stop, stop_group, block_ids):
    planned = store_window(R(*candidate), tables, tokens_per_block, chunk)

    assert planned.tokens == R(*window)
    assert (planned.stop, planned.stop_group, planned.stopped_at) == (stop, stop_group, window[1] if stop else None)
    assert [list(ids) for ids in planned.block_ids] == block_ids


def test_store_window_refuses_a_candidate_off_chunk_boundaries():
    with pytest.raises(ValueError, match=r"candidate \[0, 40\) must be an ordered range on chunk boundaries"):
        store_window(R(0, 40), [[1, 2]], [32], 32)


# -- rule 4: the coverage guard ---------------------------------------------------------------------------------
# fmt: off
COVERAGE_GAP_CASES = [
    spec("blocks_for_the_admitted_range_cover_it", [32, 32], [[1, 2], [3, 4]], (0, 64), None),
    spec("blocks_for_fewer_tokens_leave_a_gap", [32, 32], [[1, 2], [3, 4]], (0, 128), (0, 64)),
    spec("the_least_covered_block_size_is_named", [32, 64], [[1, 2, 3, 4], [5]], (0, 128), (1, 64)),
    spec("one_large_block_covers_many_chunks", [12288, 1536], [[7], [0, 0, 21]], (0, 4608), None),
    spec("scratch_groups_need_no_blocks", [32, 0], [[1, 2], []], (0, 64), None),
]
# fmt: on


@pytest.mark.parametrize(("tokens_per_block", "tables", "tokens", "gap"), COVERAGE_GAP_CASES)
def test_coverage_gap(tokens_per_block, tables, tokens, gap):
    found = find_coverage_gap(R(*tokens), tables, tokens_per_block)

    if gap is None:
        assert found is None
    else:
        assert (found.group, found.covered_tokens, found.needed) == (gap[0], gap[1], R(*tokens))
        assert f"group {gap[0]} has blocks for tokens [0, {gap[1]})" in found.reason


def test_block_ids_for_range_slices_each_group_by_its_own_block_size():
    assert block_ids_for_range(R(1536, 4608), [[7], [0, 0, 21, 22]], [12288, 1536]) == ((7,), (0, 21))
    assert block_ids_for_range(R(0, 0), [[7], [1]], [12288, 1536]) == ((), ())
    with pytest.raises(ValueError, match="too few for tokens"):
        block_ids_for_range(R(0, 128), [[1, 2]], [32])


# -- carrying a plan out with the stock LMCache 0.5.6 server ----------------------------------------------------
# fmt: off
FIT_STOCK_RETRIEVE_CASES = [
    spec("default_flags_would_write_the_recurrent_null_chunks",
         BASELINE_TABLES, [32, 32], 32, (0, 128), 0, [-1, 32], False, 128,
         None, "writes from token 0 but the first real destination is at 96"),
    spec("separate_object_groups_write_only_the_recurrent_checkpoint",
         BASELINE_TABLES, [32, 32], 32, (0, 128), 0, [-1, 32], True, 128,
         [[1, 2, 3, 4], [10, 10, 10, 10]], ""),
    spec("dense_plans_fit_as_they_are",
         [[1, 2, 3, 4]], [32], 32, (0, 128), 0, [-1], False, 128,
         [[1, 2, 3, 4]], ""),
    spec("a_null_inside_the_skipped_local_tokens_is_never_written",
         [[1, 2, 3, 4], [0, 11, 12, 13]], [32, 32], 64, (0, 128), 32, [-1, 32], False, 128,
         [[2, 2, 3, 4], [11, 11, 12, 13]], ""),
    spec("default_flags_write_the_tail_block_of_every_chunk_for_small_recurrent_blocks",
         [[1, 2, 3, 4], [0, 0, 0, 0, 0, 0, 0, 13]], [32, 16], 64, (0, 128), 0, [-1, 16], False, 128,
         None, "writes from token 48"),
    spec("separate_object_groups_write_only_the_last_small_recurrent_block",
         [[1, 2, 3, 4], [0, 0, 0, 0, 0, 0, 0, 13]], [32, 16], 64, (0, 128), 0, [-1, 16], True, 128,
         [[1, 2, 3, 4], [13] * 8], ""),
    spec("a_partial_admission_would_read_a_recurrent_object_the_lookup_never_locked",
         [[1, 2, 3, 4], [0, 11, 12, 13]], [32, 32], 32, (0, 64), 0, [-1, 32], True, 128,
         None, "reads chunks [1, 2) but the lookup locked chunks [3, 4)"),
    spec("the_seed_geometry_is_beyond_stock_0_5_6",
         SEED_TABLES, SEED_TOKENS_PER_BLOCK, SEED_CHUNK, (0, 4608), 0, [-1, 1536, 1536], True, 4608,
         None, "12288-token blocks, larger than chunk 1536"),
]
# fmt: on


@pytest.mark.parametrize(
    ("tables", "tokens_per_block", "chunk", "tokens", "skip", "sw", "separate", "lookup_hit", "wire", "why_not"),
    FIT_STOCK_RETRIEVE_CASES,
)
def test_fit_stock_retrieve(tables, tokens_per_block, chunk, tokens, skip, sw, separate, lookup_hit, wire, why_not):
    plan = plan_retrieve(R(*tokens), tables, tokens_per_block, chunk, skip_first_n_tokens=skip)

    fit = fit_stock_retrieve(
        plan, group_sw_size_tokens=sw, separate_object_groups=separate, num_lookup_hit_tokens=lookup_hit
    )

    assert fit.ok is (wire is not None), fit.reason
    assert [list(ids) for ids in fit.block_ids] == (wire or [])
    assert why_not in fit.reason


def test_fit_stock_retrieve_refuses_a_failed_plan():
    plan = plan_retrieve(R(0, 64), [[1, 2], [0, 0]], [32, 32], 32)

    with pytest.raises(ValueError, match="only a retrieve plan can be sent, got a fail_closed plan"):
        fit_stock_retrieve(plan, group_sw_size_tokens=[-1, 32], separate_object_groups=True, num_lookup_hit_tokens=64)


# fmt: off
STOCK_WRITE_TOKENS_CASES = [
    spec("full_attention_writes_every_chunk_whole", -1, True, (-1, 64)),
    spec("a_small_window_by_default_writes_the_tail_of_every_chunk", 16, False, (-1, 16)),
    spec("a_small_window_with_separate_groups_writes_the_tail_of_the_last_chunk", 16, True, (1, 16)),
    spec("a_one_chunk_window_writes_the_last_chunk", 64, True, (1, 64)),
    spec("a_window_rounds_up_to_whole_chunks", 100, True, (2, 64)),
]
# fmt: on


@pytest.mark.parametrize(("sw", "separate", "expected"), STOCK_WRITE_TOKENS_CASES)
def test_stock_write_tokens(sw, separate, expected):
    assert stock_write_tokens(sw, 64, separate_object_groups=separate) == expected


# -- properties -------------------------------------------------------------------------------------------------
@st.composite
def admissions(draw):
    chunk = draw(st.sampled_from([16, 32, 64]))
    lookup_hit = draw(st.integers(0, 8)) * chunk
    alignment = draw(st.sampled_from([size for size in (8, 16, 32, 64) if chunk % size == 0]))
    vllm_hit = draw(st.integers(0, 10)) * alignment
    computed = vllm_hit + draw(st.integers(0, alignment - 1))
    admitted = draw(st.one_of(st.none(), st.integers(0, 10 * chunk)))
    return chunk, vllm_hit, lookup_hit, admitted, computed


@settings(max_examples=300, deadline=None)
@given(admissions())
def test_every_locked_chunk_is_released_once_and_a_retrieve_passes_neither_the_admission_nor_the_hit(case):
    chunk, vllm_hit, lookup_hit, admitted, computed = case

    planned = admitted_range(
        chunk_size=chunk,
        num_vllm_hit_tokens=vllm_hit,
        num_lookup_hit_tokens=lookup_hit,
        num_admitted_external_tokens=admitted,
        num_computed_tokens=computed,
    )

    consumers = [*planned.release_now, *([planned.retrieve] if planned.retrieve else [])]
    assert all(r.start % chunk == 0 and r.end % chunk == 0 and r.end > r.start for r in consumers)
    assert sorted(c for r in consumers for c in range(r.start // chunk, r.end // chunk)) == list(
        range(lookup_hit // chunk)
    )
    if planned.retrieve is None:
        return
    assert vllm_hit < planned.exact_admitted_end <= planned.retrieve.end <= lookup_hit
    assert planned.retrieve.start + planned.skip_first_n_tokens == vllm_hit
    if admitted is not None:
        assert admitted > 0
        assert min(lookup_hit, computed + admitted) <= planned.retrieve.end <= ceil_to_chunk(computed + admitted, chunk)


@st.composite
def block_tables(draw):
    chunk = draw(st.sampled_from([32, 64]))
    tokens_per_block = draw(st.lists(st.sampled_from([0, 16, 32, 64, 128]), min_size=1, max_size=3))
    if not any(tokens_per_block):
        tokens_per_block[0] = 32
    num_chunks = draw(st.integers(1, 6))
    tables = []
    for size in tokens_per_block:
        count = max(0, -(-num_chunks * chunk // size) + draw(st.integers(-1, 1))) if size else 0
        tables.append(draw(st.lists(st.sampled_from([0, 0, 3, 5, 8, 13, 21]), min_size=count, max_size=count)))
    start_chunk = draw(st.integers(0, num_chunks - 1))
    tokens = R(start_chunk * chunk, draw(st.integers(start_chunk + 1, num_chunks)) * chunk)
    skip = draw(st.integers(0, tokens.num_tokens - 1))
    return chunk, tokens_per_block, tables, tokens, skip


def stock_written_blocks(tokens, skip, chunk, tokens_per_block, sw, separate):
    """Block indices the stock server writes for one group, modelled independently of the planning code."""
    chunk_ends = list(range(tokens.start + chunk, tokens.end + 1, chunk))
    if separate and sw >= 0:
        keep = -(-sw // chunk)  # ceil(window / chunk): LMCache 0.5.6 keeps a window group's last this many chunks
        chunk_ends = chunk_ends[-keep:]
    tail = chunk if sw < 0 else min(sw, chunk)
    written = set()
    for end in chunk_ends:
        for token in range(max(end - tail, tokens.start + skip), end):
            written.add(token // tokens_per_block)
    return written


@settings(max_examples=300, deadline=None)
@given(block_tables(), st.booleans())
@example(case=(32, [32, 32], [[3, 3, 3, 0], [0, 0, 3, 0]], R(0, 96), 0), separate=True)  # a window behind 3 chunks
def test_no_plan_ever_names_the_null_block_as_a_destination_or_a_source(case, separate):
    chunk, tokens_per_block, tables, tokens, skip = case

    plan = plan_retrieve(tokens, tables, tokens_per_block, chunk, skip_first_n_tokens=skip)
    window = store_window(tokens, tables, tokens_per_block, chunk)

    assert all(0 not in ids for ids in window.block_ids)
    assert window.tokens.start == tokens.start and window.tokens.end % chunk == 0
    assert tokens.start <= window.tokens.end <= tokens.end
    if plan.kind == "fail_closed":
        assert plan.locks_to_release == (tokens,)
        return
    for group in plan.groups:
        assert 0 not in group.block_ids
        real = [i for i, block in enumerate(group.block_ids) if block != SKIPPED_BLOCK_ID]
        if not group.is_scratch:
            assert real and real == list(range(real[0], len(group.block_ids)))
            assert tokens.start + skip <= group.first_write_token < tokens.end
    sw = [size if index else -1 for index, size in enumerate(tokens_per_block)]
    fit = fit_stock_retrieve(
        plan, group_sw_size_tokens=sw, separate_object_groups=separate, num_lookup_hit_tokens=tokens.end
    )
    if not fit.ok:
        return
    for group, ids, table, size, window_tokens in zip(
        plan.groups, fit.block_ids, tables, tokens_per_block, sw, strict=True
    ):
        if group.is_scratch:
            continue
        first = tokens.start // size
        assert len(ids) == -(-tokens.end // size) - first
        assert all(block not in (0, SKIPPED_BLOCK_ID) for block in ids)
        for index in stock_written_blocks(tokens, skip, chunk, size, window_tokens, separate):
            assert ids[index - first] == table[index] != 0
