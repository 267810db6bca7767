"""UnsentStores: when the R3 read from the slot mirror goes out, and what one store call then carries."""

import pytest

from lmcache_r3.mp.unsent_stores import TOKEN_ID_BYTES, UnsentStores

CHUNK = 4
PROMPT = 10
"""Every request below has a 10-token prompt: chunks [0, 4) and [4, 8) hold prompt tokens only, [8, 12) the end of the
prompt and generated tokens."""


def add(unsent: UnsentStores, request_id: str, item, step: int) -> None:
    """Hold ``item`` as the scheduler does: its first chunk holds prompt tokens only if it ends within the prompt."""
    unsent.add(request_id, item, item[1] + CHUNK <= PROMPT, step)


def store(start: int, end: int, tag: bytes = b"r") -> tuple[list[int], int, bytes, int, str]:
    """The store of chunks ``[start, end)``: token ids ``0..end``, one object byte string per chunk."""
    return list(range(end)), start, b"".join(tag + bytes([c]) for c in range(start // CHUNK, end // CHUNK)), end, ""


@pytest.mark.parametrize(
    "stores, ended, reported, due",
    [
        ([], set(), 100, False),  # nothing held
        ([("a", 0, 8, 0)], set(), 1, False),  # a prompt store waited 1 of 2 steps
        ([("a", 0, 8, 0)], set(), 2, True),  # ... and 2: it goes out
        ([("a", 12, 16, 0)], set(), 1000, False),  # generated tokens: no other request can use them yet
        ([("a", 8, 12, 0)], set(), 1000, False),  # the end of the prompt with generated tokens: the same
        ([("a", 8, 12, 0)], {"a"}, 1, True),  # ... until the request ends or is preempted
        ([("a", 8, 12, 0)], {"b"}, 1, False),  # another request ending sends nothing
        ([("a", 8, 12, 0), ("b", 4, 12, 5)], set(), 6, False),  # the prompt store came at step 5
        ([("a", 8, 12, 0), ("b", 4, 12, 5)], set(), 7, True),  # ... and takes the generated one along
    ],
)
def test_a_store_goes_out_when_someone_could_use_it(stores, ended, reported, due):
    unsent = UnsentStores(batch_steps=2)
    for request_id, start, end, at_step in stores:
        add(unsent, request_id, store(start, end), at_step)
    for request_id in ended:
        unsent.flush_for(request_id)
    assert unsent.due(reported) is due


def test_without_batch_steps_every_store_goes_out_in_its_step():
    unsent = UnsentStores(batch_steps=0)
    add(unsent, "a", store(8, 12), 0)
    assert unsent.due(0)


def test_too_many_bytes_waiting_send_everything():
    item = store(8, 12)
    held = TOKEN_ID_BYTES * len(item[0]) + len(item[2])
    unsent = UnsentStores(batch_steps=2, max_nbytes=2 * held)
    add(unsent, "a", item, 0)
    assert not unsent.due(50)
    add(unsent, "b", store(8, 12), 0)
    assert unsent.due(50)


def test_a_request_that_ends_before_its_last_chunks_are_read_sends_them_in_that_step():
    """vLLM reports a request finished before the step's rows arrive; its last chunks are read after that, in the
    same engine step, and go out with the step's check."""
    unsent = UnsentStores(batch_steps=2)
    unsent.flush_for("a")
    add(unsent, "a", store(8, 16), 0)
    assert unsent.due(0)


def test_an_ended_request_is_forgotten_once_checked():
    """A request that ended with nothing held does not flush the stores of a later check."""
    unsent = UnsentStores(batch_steps=2)
    unsent.flush_for("gone")
    assert not unsent.due(0)
    add(unsent, "gone", store(8, 12), 1)  # (a request id used again later)
    assert not unsent.due(100)


def test_following_stores_of_one_request_are_merged_into_one_with_the_latest_token_ids():
    unsent = UnsentStores(batch_steps=2)
    add(unsent, "a", store(0, 8), 0)
    add(unsent, "b", store(8, 12, b"b"), 0)
    add(unsent, "a", store(8, 12), 1)
    add(unsent, "a", store(12, 16), 2)
    assert unsent.nbytes == TOKEN_ID_BYTES * (16 + 12) + len(store(0, 16)[2]) + len(store(8, 12, b"b")[2])
    items, publishers = unsent.take()
    assert publishers == ("a", "b")
    assert items == [store(0, 16), store(8, 12, b"b")]
    assert not unsent and unsent.nbytes == 0 and not unsent.due(100)


@pytest.mark.parametrize(
    "second",
    [
        (list(range(20)), 16, b"x", 20, ""),  # a gap: [12, 16) was never stored
        (list(range(12)), 8, b"x", 12, "salt"),  # another cache salt
    ],
)
def test_stores_that_do_not_follow_each_other_stay_apart(second):
    unsent = UnsentStores(batch_steps=2)
    add(unsent, "a", store(0, 12), 0)
    add(unsent, "a", second, 1)
    items, publishers = unsent.take()
    assert items == [store(0, 12), second] and publishers == ("a", "a")
