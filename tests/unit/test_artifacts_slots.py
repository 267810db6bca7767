"""Slot mirror: rows follow the KV slots they were written with, read back per block table, never as silent zeros."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_r3.artifacts import R3Profile, SlotMirror, SlotMirrorError

PROFILE = R3Profile(4, 2, 32)
BLOCK = 16


def rows_for(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, PROFILE.num_experts, (count, *PROFILE.row_shape)).astype(PROFILE.dtype)


def slots_of(block_table: list[int], positions: range) -> np.ndarray:
    pos = np.arange(positions.start, positions.stop)
    return np.asarray(block_table)[pos // BLOCK] * BLOCK + pos % BLOCK


def test_rows_written_with_a_steps_slot_mapping_read_back_through_the_block_table():
    mirror = SlotMirror(PROFILE, num_blocks=10, block_size=BLOCK)
    table = [7, 3]
    prefill = rows_for(20, seed=1)

    mirror.write(slots_of(table, range(0, 20)), prefill)

    np.testing.assert_array_equal(mirror.read(table, 0, 20), prefill)
    np.testing.assert_array_equal(mirror.read(table, 5, 18), prefill[5:18])


def test_slots_follow_vllms_layout_block_times_block_size_plus_offset():
    mirror = SlotMirror(PROFILE, num_blocks=10, block_size=BLOCK)

    slots = mirror.slots_for([7, 3], 14, 20)

    assert slots.tolist() == [126, 127, 48, 49, 50, 51]


def test_two_requests_sharing_a_prefix_block_read_the_same_rows():
    mirror = SlotMirror(PROFILE, num_blocks=10, block_size=BLOCK)
    first = rows_for(32, seed=2)
    mirror.write(slots_of([4, 5], range(0, 32)), first)
    second_tail = rows_for(16, seed=3)
    mirror.write(slots_of([4, 9], range(16, 32)), second_tail)  # prefix-cache hit on block 4

    np.testing.assert_array_equal(mirror.read([4, 9], 0, 32), np.concatenate([first[:16], second_tail]))
    np.testing.assert_array_equal(mirror.read([4, 5], 0, 32), first)


def test_padding_slots_are_skipped():
    mirror = SlotMirror(PROFILE, num_blocks=2, block_size=BLOCK)
    rows = rows_for(3, seed=4)

    mirror.write(np.array([0, -1, 1]), rows)

    np.testing.assert_array_equal(mirror.read([0], 0, 2), rows[[0, 2]])


def test_a_slot_never_written_is_an_error_not_zeros():
    mirror = SlotMirror(PROFILE, num_blocks=4, block_size=BLOCK)
    mirror.write(slots_of([2], range(0, 10)), rows_for(10, seed=5))

    with pytest.raises(SlotMirrorError, match=r"no R3 row was written for position 10 \(block 2, slot 42\)"):
        mirror.read([2], 0, 11)


def test_forgotten_blocks_read_as_unwritten():
    mirror = SlotMirror(PROFILE, num_blocks=4, block_size=BLOCK)
    mirror.write(slots_of([1, 2], range(0, 32)), rows_for(32, seed=6))

    mirror.forget_blocks([2])

    mirror.read([1], 0, 16)
    with pytest.raises(SlotMirrorError, match="block 2"):
        mirror.read([1, 2], 0, 17)


@pytest.mark.parametrize(
    ("call", "message_part"),
    [
        (lambda m: m.write(np.array([64]), rows_for(1, 0)), "slot id 64 is past the pool of 64 slots"),
        (lambda m: m.write(np.array([0, 1]), rows_for(1, 0)), "one per slot id"),
        (lambda m: m.write(np.array([0.5]), rows_for(1, 0)), "integer array"),
        (lambda m: m.write(np.array([0]), np.zeros((1, 4, 2), np.int32)), "uint8"),
        (lambda m: m.read([1], 0, 17), "covers 16 positions, fewer than the 17 needed"),
        (lambda m: m.read([4], 0, 1), "block id 4 is outside the pool of 4 blocks"),
        (lambda m: m.read([-2], 0, 1), "block id -2"),
        (lambda m: m.read([1], 5, 3), "0 <= start <= end"),
        (lambda m: m.forget_blocks([9]), "block ids must be in [0, 4)"),
    ],
)
def test_invalid_writes_and_reads_are_refused_with_the_numbers(call, message_part):
    mirror = SlotMirror(PROFILE, num_blocks=4, block_size=BLOCK)

    with pytest.raises(SlotMirrorError) as caught:
        call(mirror)

    assert message_part in str(caught.value)


def test_mirror_reports_its_memory_sized_to_the_kv_pool():
    mirror = SlotMirror(R3Profile(48, 8, 128), num_blocks=1000, block_size=16)

    assert mirror.nbytes == 1000 * 16 * 384 + 1000 * 16


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_pool_dimensions_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="must be a positive int"):
        SlotMirror(PROFILE, num_blocks=bad, block_size=16)


def test_queued_steps_apply_in_order_before_any_read_or_forget():
    mirror = SlotMirror(PROFILE, num_blocks=10, block_size=BLOCK)
    table = [4]
    first, again = rows_for(8, seed=1), rows_for(8, seed=2)
    mirror.queue(slots_of(table, range(0, 8)), first)
    mirror.queue(slots_of(table, range(4, 12)), again)  # positions 4..7 recomputed in a later step
    np.testing.assert_array_equal(mirror.read(table, 0, 4), first[:4])
    np.testing.assert_array_equal(mirror.read(table, 4, 12), again)
    mirror.queue(slots_of(table, range(0, 2)), first[:2])
    mirror.forget_blocks(table)  # the queued step came first: the forget wins
    with pytest.raises(SlotMirrorError, match="no R3 row was written for position 0"):
        mirror.read(table, 0, 1)


def test_the_queue_is_applied_once_it_holds_max_queued_rows_and_refuses_a_step_with_a_slot_past_the_pool():
    mirror = SlotMirror(PROFILE, num_blocks=10, block_size=BLOCK)
    mirror.max_queued_rows = 16
    for step in range(4):
        mirror.queue(slots_of([2], range(4 * step, 4 * step + 4)), rows_for(4, seed=step))
    assert not mirror._queued  # 16 rows reached: applied
    mirror.queue(slots_of([3], range(0, 4)), rows_for(4, seed=8))
    with pytest.raises(SlotMirrorError, match="past the pool of 160 slots"):
        mirror.queue(np.array([5, 160]), rows_for(2, seed=9))  # refused as it arrives, whole
    np.testing.assert_array_equal(mirror.read([3], 0, 4), rows_for(4, seed=8))  # the step queued before it stays
    with pytest.raises(SlotMirrorError, match="no R3 row was written for position 5"):
        mirror.read([0], 5, 6)  # slot 5 of the refused step was not written


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_mirror_matches_a_slot_dictionary_under_random_steps(data):
    num_blocks, block_size = 12, 4
    mirror = SlotMirror(PROFILE, num_blocks=num_blocks, block_size=block_size)
    model: dict[int, np.ndarray] = {}
    for step in range(data.draw(st.integers(1, 8))):
        action = data.draw(st.sampled_from(["write", "queue", "forget"]))
        if action == "forget":
            blocks = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=3, unique=True))
            mirror.forget_blocks(blocks)
            model = {s: row for s, row in model.items() if s // block_size not in blocks}
            continue
        slots = data.draw(st.lists(st.integers(-1, num_blocks * block_size - 1), max_size=20, unique=True))
        rows = rows_for(len(slots), seed=step)
        getattr(mirror, action)(np.asarray(slots, dtype=np.int64), rows)
        model.update({s: rows[i] for i, s in enumerate(slots) if s >= 0})

    table = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=4, unique=True))
    end = data.draw(st.integers(0, len(table) * block_size))
    wanted = [table[p // block_size] * block_size + p % block_size for p in range(end)]
    if all(s in model for s in wanted):
        expected = np.stack([model[s] for s in wanted]) if wanted else np.empty((0, *PROFILE.row_shape))
        np.testing.assert_array_equal(mirror.read(table, 0, end), expected)
    else:
        with pytest.raises(SlotMirrorError, match="no R3 row was written"):
            mirror.read(table, 0, end)
