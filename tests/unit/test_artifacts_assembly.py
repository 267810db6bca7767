"""Request assembly: overwrite on recompute, reject gaps, truncate, materialize only complete R3, publish each
chunk once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_r3.artifacts import (
    MissingRowsError,
    R3Profile,
    RequestRows,
    RowGapError,
    TokenRange,
    missing_ranges,
)

PROFILE = R3Profile(3, 2, 64)
CHUNK = 4


def rows_for(positions: range, generation: int = 0) -> np.ndarray:
    """Rows whose ids encode their position and a generation, so a test can tell which write a row came from."""
    ids = (np.arange(positions.start, positions.stop)[:, None, None] * 7 + generation * 13) % PROFILE.num_experts
    return np.broadcast_to(ids, (len(positions), *PROFILE.row_shape)).astype(PROFILE.dtype)


@pytest.mark.parametrize(
    ("present", "needed", "missing"),
    [
        ((0, 0), (0, 10), [(0, 10)]),
        ((0, 10), (0, 10), []),
        ((0, 12), (0, 10), []),
        ((4, 10), (0, 10), [(0, 4)]),
        ((0, 6), (0, 10), [(6, 10)]),
        ((256, 1000), (0, 1023), [(0, 256), (1000, 1023)]),
        ((5, 8), (0, 0), []),
        ((20, 30), (0, 10), [(0, 10)]),
    ],
)
def test_missing_ranges_are_the_parts_of_needed_not_present(present, needed, missing):
    assert missing_ranges(TokenRange(*present), TokenRange(*needed)) == [TokenRange(*m) for m in missing]


def test_rows_written_in_steps_materialize_without_the_last_token():
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 5)))  # prefill
    request.write(5, rows_for(range(5, 6)))  # decode steps
    request.write(6, rows_for(range(6, 7)))

    routed = request.materialize(num_tokens=8)

    assert routed.shape == (7, 3, 2)
    np.testing.assert_array_equal(routed, rows_for(range(0, 7)))


def test_recomputed_rows_overwrite_the_earlier_ones():
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 10), generation=0))

    request.write(3, rows_for(range(3, 6), generation=1))

    routed = request.materialize(11)
    np.testing.assert_array_equal(routed[3:6], rows_for(range(3, 6), generation=1))
    np.testing.assert_array_equal(routed[:3], rows_for(range(0, 3)))
    np.testing.assert_array_equal(routed[6:], rows_for(range(6, 10)))


def test_a_request_may_start_at_a_cached_position_and_fill_the_prefix_later():
    request = RequestRows(PROFILE, CHUNK)
    request.write(8, rows_for(range(8, 12)))  # computed after a cache hit of 8 tokens

    with pytest.raises(MissingRowsError, match=r"rows \[0, 8\) are missing") as caught:
        request.materialize(13)
    assert caught.value.missing == [TokenRange(0, 8)]

    request.write(0, rows_for(range(0, 8)))  # rows fetched for the hit
    np.testing.assert_array_equal(request.materialize(13), rows_for(range(0, 12)))


@pytest.mark.parametrize(("start", "count"), [(11, 2), (0, 2), (20, 1)])
def test_a_write_that_leaves_a_gap_is_rejected_and_changes_nothing(start, count):
    request = RequestRows(PROFILE, CHUNK)
    request.write(4, rows_for(range(4, 10)))

    with pytest.raises(RowGapError, match=r"would leave a gap next to the present rows \[4, 10\)"):
        request.write(start, rows_for(range(start, start + count)))

    assert request.present == TokenRange(4, 10)


def test_a_write_touching_either_end_extends_the_present_rows():
    request = RequestRows(PROFILE, CHUNK)
    request.write(4, rows_for(range(4, 10)))

    request.write(10, rows_for(range(10, 12)))
    request.write(1, rows_for(range(1, 4)))

    assert request.present == TokenRange(1, 12)


def test_truncate_drops_a_rejected_speculative_tail():
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 10)))  # 3 draft tokens at 7..9, only one accepted

    request.truncate(8)

    assert request.present == TokenRange(0, 8)
    with pytest.raises(MissingRowsError, match=r"\[8, 10\)"):
        request.materialize(11)
    with pytest.raises(RowGapError):
        request.write(9, rows_for(range(9, 10)))


def test_materialize_names_every_missing_range_and_the_fix():
    request = RequestRows(PROFILE, CHUNK)
    request.write(2, rows_for(range(2, 5)))

    with pytest.raises(MissingRowsError) as caught:
        request.materialize(10)

    assert caught.value.missing == [TokenRange(0, 2), TokenRange(5, 9)]
    assert "rows [0, 2), [5, 9) are missing (present [2, 5))" in str(caught.value)
    assert "recomputed" in str(caught.value)


def test_materialize_of_a_one_token_request_is_empty_and_zero_tokens_is_an_error():
    request = RequestRows(PROFILE, CHUNK)

    assert request.materialize(1).shape == (0, 3, 2)
    with pytest.raises(ValueError, match="num_tokens must be a positive int"):
        request.materialize(0)


def test_materialized_array_is_read_only_and_never_changes_when_the_request_changes_later():
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 6)))
    routed = request.materialize(7)

    request.write(0, rows_for(range(0, 6), generation=5))
    request.write(6, rows_for(range(6, 40)))

    assert not routed.flags.writeable
    np.testing.assert_array_equal(routed, rows_for(range(0, 6)))
    np.testing.assert_array_equal(request.materialize(7), rows_for(range(0, 6), generation=5))


def test_wrong_dtype_or_shape_is_rejected_with_the_expected_layout():
    request = RequestRows(PROFILE, CHUNK)

    with pytest.raises(TypeError, match="narrow_rows"):
        request.write(0, np.zeros((2, 3, 2), np.int32))
    with pytest.raises(ValueError, match=r"expected \[n, 3, 2\]"):
        request.write(0, np.zeros((2, 2, 3), np.uint8))


def test_full_chunks_are_handed_out_once_in_order_and_the_tail_waits():
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 10)))

    assert request.ready_chunks() == [TokenRange(0, 4), TokenRange(4, 8)]
    request.mark_published(8)
    assert request.ready_chunks() == []

    request.write(10, rows_for(range(10, 13)))
    assert request.ready_chunks() == [TokenRange(8, 12)]


def test_ready_chunks_stop_at_the_store_window_limit():
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 16)))

    assert request.ready_chunks(limit_end=9) == [TokenRange(0, 4), TokenRange(4, 8)]


def test_no_chunk_is_ready_while_rows_at_the_watermark_are_missing():
    request = RequestRows(PROFILE, CHUNK)
    request.write(8, rows_for(range(8, 16)))

    assert request.ready_chunks() == []

    request.write(0, rows_for(range(0, 8)))
    request.mark_published(8)  # those chunks came from the store
    assert request.ready_chunks() == [TokenRange(8, 12), TokenRange(12, 16)]


def test_rewriting_published_rows_changes_the_output_but_does_not_republish():
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 8)))
    request.mark_published(8)

    request.write(0, rows_for(range(0, 8), generation=2))

    assert request.ready_chunks() == []
    np.testing.assert_array_equal(request.materialize(9), rows_for(range(0, 8), generation=2))


def test_truncating_below_the_watermark_offers_those_chunks_again_once_rewritten():
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 12)))
    request.mark_published(12)

    request.truncate(6)
    assert request.published_end == 4
    request.write(6, rows_for(range(6, 12), generation=3))

    assert request.ready_chunks() == [TokenRange(4, 8), TokenRange(8, 12)]


@pytest.mark.parametrize(
    ("end", "error", "message_part"),
    [
        (6, ValueError, "multiple of the chunk size 4"),
        (12, MissingRowsError, "[8, 12)"),
    ],
)
def test_mark_published_refuses_unaligned_or_missing_chunks(end, error, message_part):
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 8)))

    with pytest.raises(error) as caught:
        request.mark_published(end)

    assert message_part in str(caught.value)
    assert request.published_end == 0


def test_rows_view_is_read_only_and_refuses_missing_positions():
    request = RequestRows(PROFILE, CHUNK)
    request.write(0, rows_for(range(0, 8)))

    view = request.rows(4, 8)

    assert not view.flags.writeable
    np.testing.assert_array_equal(view, rows_for(range(4, 8)))
    with pytest.raises(MissingRowsError, match=r"\[8, 9\) missing"):
        request.rows(4, 9)


def test_capacity_grows_geometrically_and_keeps_every_row():
    request = RequestRows(PROFILE, CHUNK, capacity_tokens=2)
    for position in range(0, 300):
        request.write(position, rows_for(range(position, position + 1)))

    np.testing.assert_array_equal(request.materialize(301), rows_for(range(0, 300)))
    assert request.nbytes <= 2 * 300 * PROFILE.bytes_per_token


# -- model-based property: the assembly behaves like a dict {position: row} with the documented rules ------------
write_op = st.tuples(st.just("write"), st.integers(0, 40), st.integers(0, 12), st.integers(0, 9))
truncate_op = st.tuples(st.just("truncate"), st.integers(0, 45), st.just(0), st.just(0))
publish_op = st.tuples(st.just("publish"), st.integers(0, 12), st.just(0), st.just(0))
materialize_op = st.tuples(st.just("materialize"), st.integers(1, 45), st.just(0), st.just(0))


@settings(max_examples=250, deadline=None)
@given(
    ops=st.lists(st.one_of(write_op, truncate_op, publish_op, materialize_op), max_size=25),
    num_tokens=st.integers(1, 45),
)
def test_assembly_matches_a_position_dictionary_under_any_sequence_of_operations(ops, num_tokens):
    request = RequestRows(PROFILE, CHUNK)
    model: dict[int, np.ndarray] = {}
    published: set[int] = set()
    handed_out: list[tuple[np.ndarray, np.ndarray]] = []  # (array returned, copy of it at that time)

    for op, a, b, generation in ops:
        if op == "write":
            new = rows_for(range(a, a + b), generation)
            touches = not model or b == 0 or (a <= max(model) + 1 and a + b >= min(model))
            if touches:
                request.write(a, new)
                model.update({a + i: new[i] for i in range(b)})
            else:
                with pytest.raises(RowGapError):
                    request.write(a, new)
        elif op == "truncate":
            request.truncate(a)
            model = {p: r for p, r in model.items() if p < a}
            published = {c for c in published if c + CHUNK <= a - a % CHUNK}
        elif op == "materialize":
            if all(p in model for p in range(a - 1)):
                routed = request.materialize(a)
                handed_out.append((routed, routed.copy()))
        else:
            for chunk in request.ready_chunks()[:a]:
                assert all(p in model for p in range(*chunk)), "a chunk with missing rows was offered"
                assert chunk.start not in published, "a chunk was offered twice"
                published.add(chunk.start)
                request.mark_published(chunk.end)

        present = sorted(model)
        expected_present = TokenRange(present[0], present[-1] + 1) if present else TokenRange(0, 0)
        assert len(present) == expected_present.num_tokens, "rows present are not contiguous"
        assert request.present == expected_present

    for routed, snapshot in handed_out:
        np.testing.assert_array_equal(routed, snapshot)
    needed = range(0, num_tokens - 1)
    if all(p in model for p in needed):
        expected = np.stack([model[p] for p in needed]) if needed else np.empty((0, *PROFILE.row_shape))
        np.testing.assert_array_equal(request.materialize(num_tokens), expected)
    else:
        with pytest.raises(MissingRowsError) as caught:
            request.materialize(num_tokens)
        missing_positions = {p for r in caught.value.missing for p in range(*r)}
        assert missing_positions == {p for p in needed if p not in model}
