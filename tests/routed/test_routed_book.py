"""The scheduler-side bookkeeping of routed experts, driven step by step against a real LMCache server with the R3
module. vLLM's ``Request`` and ``SchedulerOutput`` are stood in for by the few fields the bookkeeping reads (no
engine runs here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from lmcache_r3.artifacts import R3Profile, decode_run
from lmcache_r3.mp.r3_client import R3Client
from lmcache_r3.mp.r3_messages import R3WorkerMetadata
from lmcache_r3.mp.routed import RoutedExpertsBook
from lmcache_r3.output import ROUTED_EXPERTS_ERROR_KEY, ROUTED_EXPERTS_KEY, decode_routed_experts
from tests.support.harness import wait_for
from tests.support.processes import paused

pytestmark = pytest.mark.server

CHUNK = 64
BLOCK = 32
PROFILE = R3Profile(num_layers=2, top_k=2, num_experts=8)
BLOCKS = [10, 11, 12, 13, 14]


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    status: str = "RUNNING"
    mm_features: list = field(default_factory=list)
    num_in_flight_tokens: int = 0
    num_prompt_tokens: int | None = None
    """Defaults to every token of ``all_token_ids`` (a request still in its prompt)."""

    def __post_init__(self) -> None:
        if self.num_prompt_tokens is None:
            self.num_prompt_tokens = len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class NewRequest:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0


@dataclass
class CachedRequests:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequest] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequests = field(default_factory=CachedRequests)
    kv_cache_block_copies: list | None = None
    preempted_req_ids: set[str] = field(default_factory=set)


def rows(start: int, end: int, salt: int = 0) -> np.ndarray:
    """Distinct routing per position; another ``salt`` is what a different (e.g. rejected draft) token routes to."""
    return ((np.arange(start, end)[:, None, None] * 3 + salt) % 8 * np.ones((1, 2, 2), dtype=np.int64)).astype(np.uint8)


def slots(start: int, end: int) -> np.ndarray:
    positions = np.arange(start, end)
    return np.asarray(BLOCKS)[positions // BLOCK] * BLOCK + positions % BLOCK


def worker_output(step: int, start: int, end: int, salt: int = 0) -> R3WorkerMetadata:
    return R3WorkerMetadata(step=step, slots=slots(start, end), rows=rows(start, end, salt))


def finish(book: RoutedExpertsBook, request: Request, status: str = "FINISHED_LENGTH_CAPPED") -> dict | None:
    """End ``request`` as vLLM does: ``request_finished``, then the (empty) worker output of the step it ended in,
    which completes its params."""
    request.status = status
    params = book.request_finished(request, None)
    book.on_worker_output(R3WorkerMetadata())
    return params


@pytest.fixture
def book(r3_server):
    client = R3Client(r3_server.url, "book-model", PROFILE)
    yield RoutedExpertsBook(PROFILE, CHUNK, BLOCK, num_blocks=64, client=client, fetch_timeout_s=5)
    client.close()


def start_request(book: RoutedExpertsBook, request: Request, num_scheduled: int, store_end: int = 0) -> int:
    """Look the request up (no hit) and schedule its first step, whose KV store covers ``[0, store_end)``."""
    book.begin_lookup(request, 0)
    book.end_lookup(request)
    if store_end:
        book.on_store(request.request_id, 0, store_end)
    new = NewRequest(request.request_id, (list(BLOCKS),))
    return book.on_schedule(SchedulerOutput({request.request_id: num_scheduled}, [new]), group=0)


def test_rows_of_rejected_speculative_tokens_are_never_published(book):
    tokens = list(range(100, 100 + 2 * CHUNK + 10))
    request = Request("spec", tokens)
    step = start_request(book, request, 130, store_end=2 * CHUNK)  # this step's KV store covers two chunks
    # The step computed positions [0, 110) plus drafts at [110, 130); vLLM accepted up to 110 only.
    request.num_computed_tokens = 110
    drafts = worker_output(step, 0, 130)
    drafts.rows[110:] = rows(110, 130, salt=5)
    book.on_worker_output(drafts)
    book.settle(10)
    fetched = book.client.fetch(tokens).result()
    assert fetched.num_hit_chunks == 1  # chunk [64, 128) is not complete: nothing past 110 was published
    (chunk,) = decode_run(fetched.objects, PROFILE, 0, CHUNK).chunks
    np.testing.assert_array_equal(chunk.rows, rows(0, CHUNK))
    # The next step recomputes from 110 with the accepted tokens; the second chunk is then published with them.
    step = book.on_schedule(SchedulerOutput({"spec": 20}, [], CachedRequests(["spec"], [None], set(), [110])), 0)
    request.num_computed_tokens = 130
    book.on_worker_output(worker_output(step, 110, 130))
    book.settle(10)
    fetched = book.client.fetch(tokens).result()
    assert fetched.num_hit_chunks == 2
    second = decode_run(fetched.objects, PROFILE, 0, CHUNK).chunks[1]
    np.testing.assert_array_equal(second.rows, rows(CHUNK, 2 * CHUNK))


def test_a_step_whose_rows_never_arrive_makes_the_output_an_error_never_rows(book):
    request = Request("lost", list(range(300, 300 + 40)))
    first = start_request(book, request, 20)
    request.num_computed_tokens = 20
    second = book.on_schedule(SchedulerOutput({"lost": 19}, [], CachedRequests(["lost"], [None], set(), [20])), 0)
    request.num_computed_tokens = 39
    book.on_worker_output(worker_output(second, 20, 39))  # step `first` never reported its rows
    params = finish(book, request)
    assert first == second - 1
    assert ROUTED_EXPERTS_KEY not in params
    assert f"engine step {first} never arrived" in params[ROUTED_EXPERTS_ERROR_KEY]
    # The mirror forgot those blocks: a later request hitting them in vLLM's prefix cache cannot read old rows.
    with pytest.raises(ValueError, match="no R3 row was written"):
        book.mirror.read(BLOCKS, 0, 1)


def test_a_step_whose_rows_name_slots_past_the_mirror_makes_the_output_an_error_and_keeps_the_earlier_steps(book):
    """Rows for slots the mirror does not have (a KV pool other than the engine's) are refused with their step, never
    scattered elsewhere and never an exception into vLLM's scheduler; the step queued before them keeps its rows."""
    kept = Request("kept", list(range(700, 700 + 20)))
    kept_step = start_request(book, kept, 20)
    kept.num_computed_tokens = 20
    book.on_worker_output(worker_output(kept_step, 0, 20))  # queued, not yet applied
    request = Request("past", list(range(800, 800 + 40)))
    book.begin_lookup(request, 0)
    book.end_lookup(request)
    new = NewRequest("past", ([40, 41],))
    step = book.on_schedule(SchedulerOutput({"past": 40}, [new]), group=0)
    request.num_computed_tokens = 40
    request.all_token_ids.append(7)
    bad = R3WorkerMetadata(step=step, slots=np.arange(40) + 64 * BLOCK - 8, rows=rows(0, 40))  # 8 fit, 32 do not
    book.on_worker_output(bad)
    params = finish(book, request)
    assert ROUTED_EXPERTS_KEY not in params
    assert f"engine step {step} was refused" in params[ROUTED_EXPERTS_ERROR_KEY]
    assert "past the pool" in params[ROUTED_EXPERTS_ERROR_KEY]
    np.testing.assert_array_equal(book.mirror.read(BLOCKS, 0, 20), rows(0, 20))


def test_finished_request_returns_every_position_from_the_mirror(book):
    request = Request("whole", list(range(500, 500 + 70)))
    step = start_request(book, request, 70)
    request.num_computed_tokens = 70
    request.all_token_ids.append(7)  # the token sampled in that step finishes the request
    book.on_worker_output(worker_output(step, 0, 70))
    params = finish(book, request)
    np.testing.assert_array_equal(decode_routed_experts(params[ROUTED_EXPERTS_KEY]), rows(0, 70))
    assert params["lmcache_r3_sources"] == {"vllm_cached_tokens": 0, "lmcache_tokens": 0, "computed_tokens": 70}


def test_a_request_with_multimodal_inputs_never_fetches_or_publishes_r3_and_returns_its_own_rows(book, r3_server):
    # LMCache keys the KV of an image prompt by the image's hash; an R3 key holds only token ids, the same placeholder
    # ids for every image. So such a request fetches no R3 (its LMCache hit is recomputed) and publishes none (another
    # image's prompt would be served its rows), while its own rows stay exact.
    from lmcache_r3.artifacts import encode_run

    tokens = list(range(21000, 21000 + 2 * CHUNK + 6))
    book.client.store(tokens, 0, encode_run(PROFILE, 0, rows(0, 2 * CHUNK, salt=5), CHUNK), 2 * CHUNK).result()
    assert fetched_chunks(book.client, tokens, 2) == 2  # R3 of an earlier prompt with the same token ids
    request = Request("with-image", list(tokens), mm_features=["an image"])
    fetches, calls = book.counters.snapshot()["fetches"], r3_server.status()["lmcache_r3"]["fetch_calls"]
    book.begin_lookup(request, 0)
    book.send_fetches()
    assert book.joint_hit_end(request, 2 * CHUNK) == 0, "R3 keyed by token ids served an image prompt"
    assert book.counters.snapshot()["fetches"] == fetches
    assert r3_server.status()["lmcache_r3"]["fetch_calls"] == calls
    book.end_lookup(request)
    book.on_store(request.request_id, 0, 2 * CHUNK)
    new = NewRequest(request.request_id, (list(BLOCKS),))
    step = book.on_schedule(SchedulerOutput({request.request_id: len(tokens)}, [new]), group=0)
    request.num_computed_tokens = len(tokens)
    request.all_token_ids.append(7)
    book.on_worker_output(worker_output(step, 0, len(tokens)))
    params = finish(book, request)
    book.settle(5)
    np.testing.assert_array_equal(decode_routed_experts(params[ROUTED_EXPERTS_KEY]), rows(0, len(tokens)))
    assert book.counters.snapshot()["chunks_published"] == 0 and book.counters.snapshot()["requests_local_only"] == 1
    (first, _) = decode_run(book.client.fetch(tokens).result().objects, PROFILE, 0, CHUNK).chunks
    np.testing.assert_array_equal(first.rows, rows(0, CHUNK, salt=5))  # the earlier prompt's R3, unchanged


def test_parallel_sampling_children_carry_every_siblings_rows_and_the_last_to_end_releases_the_group(book):
    # vLLM's front end adds the children one call each and keeps only the last child's params: those must hold every
    # finished sibling's rows, also of a child that ended before the next one arrived, and the group must not outlive
    # its children (after a grace for late ones), also when the last one is aborted (a stop string) before it ran.
    from vllm.v1.request import RequestStatus

    from lmcache_r3.output import SIBLINGS_KEY

    ids = [f"{index}_group" for index in range(4)]
    params = {}

    def run(index: int) -> None:
        request = Request(ids[index], list(range(800, 840)) + [index])
        step = start_request(book, request, 41)
        request.num_computed_tokens = 41
        request.all_token_ids.append(7)
        book.on_worker_output(worker_output(step, 0, 41, salt=index))
        params[ids[index]] = finish(book, request)

    book.on_new_request(ids[0])
    run(0)  # ends before its siblings are added
    assert "group" in book._siblings, "a group let go while children may still be on their way"
    for request_id in ids[1:]:
        book.on_new_request(request_id)
    book.sibling_grace_s = 0.0  # from here only the children still live keep the group
    run(1)
    run(2)
    assert "group" in book._siblings, "a group let go while a child is still to come"
    book.request_finished(Request(ids[3], [1, 2, 3], status=RequestStatus.FINISHED_ABORTED), None)
    assert book._siblings == {}, "a parallel-sampling group outlived its children"
    siblings = params[ids[2]][SIBLINGS_KEY]
    assert sorted(siblings) == ["0", "1", "2"]
    for index in range(3):
        np.testing.assert_array_equal(decode_routed_experts(siblings[str(index)]), rows(0, 41, salt=index))


def test_a_prefix_hit_ending_inside_a_block_copied_on_write_returns_the_source_blocks_rows(book):
    # With sub-block prefix hits (hybrid models with aligned Mamba state), vLLM does not share the block a hit ends in:
    # it gives the request a fresh block and copies the cached one's KV into it before the step. The fresh block
    # still holds its previous occupant's rows in the mirror; the request must get the source block's.
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    first = Request("source", list(range(900, 970)))
    step = start_request(book, first, 70)
    first.num_computed_tokens = 70
    book.on_worker_output(worker_output(step, 0, 70))
    stale = np.asarray([20]) * BLOCK + np.arange(BLOCK)
    book.mirror.write(stale, rows(0, BLOCK, salt=7))  # block 20's previous occupant
    second = Request("copy-on-write", list(range(900, 940)) + list(range(5000, 5030)))
    book.begin_lookup(second, 40)
    book.end_lookup(second)
    table = [BLOCKS[0], 20, 21]
    new = NewRequest(second.request_id, (table,), num_computed_tokens=40)
    output = SchedulerOutput({second.request_id: 30}, [new], kv_cache_block_copies=[KVCacheBlockCopy(BLOCKS[1], 20)])
    step = book.on_schedule(output, group=0)
    second.num_computed_tokens = 70
    second.all_token_ids.append(7)
    positions = np.arange(40, 70)
    computed = np.asarray(table)[positions // BLOCK] * BLOCK + positions % BLOCK
    book.on_worker_output(R3WorkerMetadata(step=step, slots=computed, rows=rows(40, 70, salt=2)))
    params = finish(book, second)
    returned = decode_routed_experts(params[ROUTED_EXPERTS_KEY])
    np.testing.assert_array_equal(returned[:40], rows(0, 40))  # vLLM's hit: the source's rows, none of block 20's
    np.testing.assert_array_equal(returned[40:], rows(40, 70, salt=2))


def test_a_store_of_a_request_preempted_before_its_rows_came_waits_for_the_rows_it_recomputes(book):
    # Async scheduling: a request stores chunk 1's KV in step 1, is preempted before step 1 reports, and resumes in
    # step 2 with vLLM's hit of chunk 0 in a new block table. When step 1's rows arrive, chunk 1's R3 is due, but its
    # new blocks hold no rows until step 2 reports: the publish waits for them, and the output has every row.
    request = Request("preempted", list(range(30000, 30133)))
    request_id = request.request_id
    step0 = start_request(book, request, 74, store_end=CHUNK)
    request.num_computed_tokens = 74
    book.on_worker_output(worker_output(step0, 0, 74))
    book.on_store(request_id, CHUNK, 2 * CHUNK)
    step1 = book.on_schedule(
        SchedulerOutput({request_id: 59}, [], CachedRequests([request_id], [None], set(), [74])), 0
    )
    request.num_computed_tokens, request.num_in_flight_tokens = 0, 59  # preempted with step 1 in flight
    table = [BLOCKS[0], BLOCKS[1], 30, 31, 32]
    book.begin_lookup(request, CHUNK)
    book.end_lookup(request)
    resumed = CachedRequests([request_id], [(table,)], {request_id}, [CHUNK])
    step2 = book.on_schedule(SchedulerOutput({request_id: 69}, [], resumed), 0)
    request.num_computed_tokens, request.num_in_flight_tokens = 133, 69  # step 2 in flight as step 1's rows arrive
    book.on_worker_output(worker_output(step1, 74, 133))  # rows for the blocks it had then
    request.num_in_flight_tokens -= 69
    positions = np.arange(CHUNK, 133)
    slots_now = np.asarray(table)[positions // BLOCK] * BLOCK + positions % BLOCK
    book.on_worker_output(R3WorkerMetadata(step=step2, slots=slots_now, rows=rows(CHUNK, 133, salt=4)))
    request.all_token_ids.append(7)
    params = finish(book, request)
    assert ROUTED_EXPERTS_ERROR_KEY not in params, params.get(ROUTED_EXPERTS_ERROR_KEY)
    returned = decode_routed_experts(params[ROUTED_EXPERTS_KEY])
    np.testing.assert_array_equal(returned[:CHUNK], rows(0, CHUNK))
    np.testing.assert_array_equal(returned[CHUNK:], rows(CHUNK, 133, salt=4))
    book.settle(5)
    assert fetched_chunks(book.client, request.all_token_ids, 2) == 2
    chunks = decode_run(book.client.fetch(request.all_token_ids).result().objects, PROFILE, 0, CHUNK).chunks
    np.testing.assert_array_equal(chunks[1].rows, rows(CHUNK, 2 * CHUNK, salt=4))


def test_r3_of_a_request_preempted_before_its_step_reported_is_never_read_through_the_blocks_it_gave_up(book):
    # Async scheduling: R stores chunk 0's KV in step 0 and is preempted in step 1, before step 0 reports. Q gets R's
    # blocks and computes into them; R, looked up again, waits for an LMCache load that already counts its tokens as
    # computed. R3 published under R's chunk key is R's own routing or nothing, never Q's.
    own, other = Request("preempted-r", list(range(41000, 41100))), Request("preempted-q", list(range(42000, 42100)))
    step0 = start_request(book, own, CHUNK, store_end=CHUNK)
    own.num_computed_tokens = own.num_in_flight_tokens = CHUNK
    book.on_schedule(SchedulerOutput({}, preempted_req_ids={own.request_id}), 0)
    own.num_computed_tokens = own.num_in_flight_tokens = 0
    book.on_worker_output(worker_output(step0, 0, CHUNK))
    q_step = start_request(book, other, CHUNK)  # R's blocks
    other.num_computed_tokens = CHUNK
    book.on_worker_output(worker_output(q_step, 0, CHUNK, salt=5))
    book.lookup_asked(own.request_id)
    book.begin_lookup(own, 0)
    book.admitted(own.request_id, 0, CHUNK)
    own.num_computed_tokens = CHUNK  # vLLM counts the tokens of the asynchronous load while it waits
    decode = CachedRequests([other.request_id], [None], set(), [CHUNK])
    step = book.on_schedule(SchedulerOutput({other.request_id: 1}, [], decode), 0)
    other.num_computed_tokens = CHUNK + 1
    book.on_worker_output(worker_output(step, CHUNK, CHUNK + 1, salt=5))
    book.settle(5)
    fetched = book.client.fetch(own.all_token_ids).result()
    for chunk in decode_run(fetched.objects, PROFILE, 0, CHUNK).chunks:
        np.testing.assert_array_equal(chunk.rows, rows(0, CHUNK), err_msg="another request's rows under R's key")
    assert book._requests[own.request_id].incomplete is None, book._requests[own.request_id].incomplete


def test_a_request_looked_up_again_after_a_failed_load_starts_at_its_new_hit_and_keeps_shared_rows(book):
    # R is admitted an LMCache hit of chunk 0; its load fails before the first valid block, so vLLM frees its blocks
    # and looks it up again, now hitting the blocks S computed in vLLM's own prefix cache. The old admission must not
    # make those blocks LMCache's: neither R nor S (nor any later hit on them) loses its rows.
    tokens = list(range(43000, 43099))
    shared, request = Request("hit-owner", list(tokens)), Request("failed-load", list(tokens))
    book.begin_lookup(request, 0)
    book.admitted(request.request_id, 0, CHUNK)
    step = start_request(book, shared, 99)
    shared.num_computed_tokens = 99
    book.on_worker_output(worker_output(step, 0, 99))
    book.lookup_asked(request.request_id)  # the load failed: vLLM asks again
    book.begin_lookup(request, CHUNK)
    book.end_lookup(request)  # LMCache has nothing past vLLM's own hit
    table = [BLOCKS[0], BLOCKS[1], 30, 31]
    step = book.on_schedule(SchedulerOutput({request.request_id: 99 - CHUNK},
                                            [NewRequest(request.request_id, (table,), CHUNK)]), 0)  # fmt: skip
    request.num_computed_tokens = 99
    positions = np.arange(CHUNK, 99)
    own_slots = np.asarray(table)[positions // BLOCK] * BLOCK + positions % BLOCK
    book.on_worker_output(R3WorkerMetadata(step=step, slots=own_slots, rows=rows(CHUNK, 99)))
    outputs = {}
    for done in (request, shared):
        done.all_token_ids.append(7)
        outputs[done.request_id] = params = finish(book, done)
        assert ROUTED_EXPERTS_ERROR_KEY not in params, params.get(ROUTED_EXPERTS_ERROR_KEY)
        np.testing.assert_array_equal(decode_routed_experts(params[ROUTED_EXPERTS_KEY]), rows(0, 99))
    sources = outputs[request.request_id]["lmcache_r3_sources"]
    assert sources == {"vllm_cached_tokens": CHUNK, "lmcache_tokens": 0, "computed_tokens": 99 - CHUNK}


def test_an_incomplete_last_child_keeps_its_siblings_rows_and_says_why_for_itself_only(book):
    # vLLM's front end returns only the last child's params: when that child's rows are incomplete, the other
    # completions' rows are still there, and only the incomplete one raises, with its own reason.
    from types import SimpleNamespace

    from lmcache_r3 import RoutedExpertsUnavailable, routed_experts, routed_experts_from_params

    ids = ["0_pair", "1_pair"]
    for request_id in ids:
        book.on_new_request(request_id)
    done = Request(ids[0], list(range(700, 720)))
    step = start_request(book, done, 20)
    done.num_computed_tokens = 20
    done.all_token_ids.append(7)
    book.on_worker_output(worker_output(step, 0, 20))
    finish(book, done)
    lost = Request(ids[1], list(range(700, 720)))
    first = start_request(book, lost, 10)  # this step's rows never arrive
    lost.num_computed_tokens = 10
    cached = CachedRequests([ids[1]], [None], set(), [10])
    second = book.on_schedule(SchedulerOutput({ids[1]: 10}, [], cached), 0)
    lost.num_computed_tokens = 20
    lost.all_token_ids.append(9)
    book.on_worker_output(worker_output(second, 10, 20))
    params = finish(book, lost)  # the last child: its params are the ones the user gets
    assert f"engine step {first} never arrived" in params[ROUTED_EXPERTS_ERROR_KEY]
    np.testing.assert_array_equal(routed_experts_from_params(params, done.all_token_ids, index=0), rows(0, 20))
    with pytest.raises(RoutedExpertsUnavailable, match=f"engine step {first} never arrived"):
        routed_experts_from_params(params, lost.all_token_ids, index=1)
    completions = [SimpleNamespace(index=0, token_ids=[7]), SimpleNamespace(index=1, token_ids=[9])]
    output = SimpleNamespace(
        outputs=completions, prompt_token_ids=list(range(700, 720)), finished=True, kv_transfer_params=params
    )
    np.testing.assert_array_equal(routed_experts(output, 0), rows(0, 20))
    with pytest.raises(RoutedExpertsUnavailable, match="incomplete"):
        routed_experts(output, 1)


def test_the_lookups_of_a_step_fetch_their_r3_in_one_call_and_an_early_kv_answer_sends_its_own(book, r3_server):
    from lmcache_r3.artifacts import encode_run

    prompts = {name: list(range(seed, seed + 2 * CHUNK + 5)) for name, seed in (("a", 1000), ("b", 3000), ("c", 5000))}
    for tokens in prompts.values():  # R3 of each prompt's first chunk only
        book.client.store(tokens, 0, encode_run(PROFILE, 0, rows(0, CHUNK), CHUNK), CHUNK).result()
    calls_before = r3_server.status()["lmcache_r3"]["fetch_calls"]
    requests = {name: Request(name, tokens) for name, tokens in prompts.items()}
    book.begin_lookup(requests["a"], 0)
    book.begin_lookup(requests["b"], 0)
    book.on_schedule(SchedulerOutput({}), group=0)  # the step's lookups are done: one call for both
    assert book.joint_hit_end(requests["a"], 2 * CHUNK) == CHUNK  # KV has 2 chunks, R3 only the first
    assert book.joint_hit_end(requests["b"], CHUNK) == CHUNK
    assert r3_server.status()["lmcache_r3"]["fetch_calls"] == calls_before + 1  # both answers came in that call
    book.begin_lookup(requests["c"], 0)
    assert book.joint_hit_end(requests["c"], 2 * CHUNK) == CHUNK  # answered before the step's fetches went out
    assert r3_server.status()["lmcache_r3"]["fetch_calls"] == calls_before + 2


@pytest.mark.parametrize("resumed", [True, False], ids=["server-resumes", "bound-passes"])
def test_a_fetch_of_a_stalled_server_is_pending_until_it_answers_or_its_bound_passes(r3_server, resumed):
    # The server is stopped (SIGSTOP) with the fetch in flight: the scheduler is told the R3 answer is still out,
    # instead of waiting for it, until the server answers (the joint hit is then the R3 hit) or the bound passes
    # (then it is an R3 miss: the KV hit is dropped and the request recomputes, never waits longer).
    import time

    from lmcache_r3.artifacts import encode_run

    bound_s = 3.0  # ten times the wait below: a busy machine must not end the fetch before the test looks again
    client = R3Client(r3_server.url, f"stall-model-{resumed}", PROFILE, timeout_s=bound_s)
    book = RoutedExpertsBook(PROFILE, CHUNK, BLOCK, num_blocks=64, client=client, fetch_timeout_s=bound_s)
    try:
        request = Request("stalled", list(range(7000, 7000 + 2 * CHUNK + 3)))
        client.store(request.all_token_ids, 0, encode_run(PROFILE, 0, rows(0, 2 * CHUNK), CHUNK), 2 * CHUNK).result()
        book.begin_lookup(request, 0)
        with paused(r3_server.pid):
            book.send_fetches()
            started = time.monotonic()
            assert book.fetch_pending(request)
            time.sleep(0.3)
            assert book.fetch_pending(request)  # still out, well within the bound
            if not resumed:
                while book.fetch_pending(request):
                    time.sleep(0.05)
                assert time.monotonic() - started < bound_s + 1.5
        if resumed:
            deadline = time.monotonic() + 5
            while book.fetch_pending(request) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not book.fetch_pending(request)
            assert book.joint_hit_end(request, 2 * CHUNK) == 2 * CHUNK
            assert book.counters.snapshot()["fetch_failures"] == 0
        else:
            assert book.joint_hit_end(request, 2 * CHUNK) == 0  # no wait: the bound has passed
            assert book.counters.snapshot()["fetch_failures"] == 1
        assert not book.fetch_pending(request)  # answered once; vLLM's next ask reuses it
    finally:
        client.close()


def test_a_store_a_stalled_server_never_answers_fails_at_its_bound_and_pauses_r3_calls(r3_server):
    # A dead server answers no store: each one is counted failed once its bound passes and R3 calls pause (as after a
    # fetch timeout), instead of piling up unanswered for as long as the server is gone.
    import time

    client = R3Client(r3_server.url, "stalled-store-model", PROFILE, timeout_s=0.5)
    book = RoutedExpertsBook(PROFILE, CHUNK, BLOCK, num_blocks=64, client=client, fetch_timeout_s=0.5)
    try:
        request = Request("stalled-store", list(range(19000, 19000 + CHUNK + 4)))
        step = start_request(book, request, CHUNK + 4, store_end=CHUNK)
        request.num_computed_tokens = CHUNK + 4
        with paused(r3_server.pid):
            book.on_worker_output(worker_output(step, 0, CHUNK + 4))  # chunk 0 complete: its store goes out
            assert len(book._stores) == 1 and book._server_answers()
            time.sleep(0.8)  # past the bound
            book.on_worker_output(R3WorkerMetadata())
            assert book._stores == [], "a store past its bound is still waited for"
            assert book.counters.snapshot()["store_failures"] == 1
            assert not book._server_answers(), "R3 calls go on to a server that stopped answering"
    finally:
        client.close()


def fetched_chunks(client: R3Client, tokens: list[int], expected: int) -> int:
    """Leading chunks of ``tokens`` with R3 on the server, once ``expected`` (or whatever it is after 5 s)."""
    return wait_for(lambda: client.fetch(tokens).result().num_hit_chunks, expected, 5.0)


def continue_request(book: RoutedExpertsBook, request: Request, start: int, end: int, store_end: int = 0) -> None:
    """One more engine step of ``request`` computing ``[start, end)`` (its KV store covering up to ``store_end``),
    with its rows reported."""
    if store_end:
        book.on_store(request.request_id, start, store_end)
    cached = CachedRequests([request.request_id], [None], set(), [start])
    step = book.on_schedule(SchedulerOutput({request.request_id: end - start}, [], cached), 0)
    request.num_computed_tokens = end
    book.on_worker_output(worker_output(step, start, end))


@pytest.fixture
def batched_book(r3_server, request):
    client = R3Client(r3_server.url, f"batched-{request.node.name}", PROFILE)
    yield RoutedExpertsBook(PROFILE, CHUNK, BLOCK, num_blocks=64, client=client, fetch_timeout_s=5,
                            store_batch_steps=getattr(request, "param", 100))  # fmt: skip
    client.close()


@pytest.mark.parametrize("batched_book", [2], indirect=True)
def test_r3_of_a_running_request_goes_out_in_one_store_call_once_the_batch_steps_passed(batched_book, r3_server):
    book = batched_book
    request = Request("batched", list(range(9000, 9000 + 2 * CHUNK + 10)))
    calls_before = r3_server.status()["lmcache_r3"]["store_calls"]
    step = start_request(book, request, CHUNK, store_end=CHUNK)
    request.num_computed_tokens = CHUNK
    book.on_worker_output(worker_output(step, 0, CHUNK))  # chunk 0 complete: read, not sent
    continue_request(book, request, CHUNK, 2 * CHUNK, store_end=2 * CHUNK)  # chunk 1: one step later
    assert book.client.fetch(request.all_token_ids).result().num_hit_chunks == 0
    assert r3_server.status()["lmcache_r3"]["store_calls"] == calls_before
    continue_request(book, request, 2 * CHUNK, 2 * CHUNK + 5)  # two steps after chunk 0: both go out together
    assert fetched_chunks(book.client, request.all_token_ids, 2) == 2
    assert r3_server.status()["lmcache_r3"]["store_calls"] == calls_before + 1
    objects = book.client.fetch(request.all_token_ids).result().objects
    chunks = decode_run(objects, PROFILE, 0, CHUNK).chunks
    np.testing.assert_array_equal(np.concatenate([chunk.rows for chunk in chunks]), rows(0, 2 * CHUNK))


def test_a_finishing_requests_r3_goes_out_in_its_last_step(batched_book):
    book = batched_book
    request = Request("finishing", list(range(11000, 11000 + CHUNK + 6)))
    step = start_request(book, request, CHUNK + 6, store_end=CHUNK)
    request.num_computed_tokens = CHUNK + 6
    book.on_worker_output(worker_output(step, 0, CHUNK + 6))
    assert book.client.fetch(request.all_token_ids).result().num_hit_chunks == 0  # batched: 100 steps to go
    finish(book, request, "FINISHED_STOPPED")
    assert fetched_chunks(book.client, request.all_token_ids, 1) == 1  # its next turn finds it at once


def test_an_aborted_requests_complete_r3_goes_out_at_the_abort_without_another_step(batched_book):
    from vllm.v1.request import RequestStatus

    book = batched_book
    request = Request("aborted", list(range(13000, 13000 + CHUNK + 20)))
    book.begin_lookup(Request("still-waiting", list(range(17000, 17000 + 10))), 0)  # the engine keeps a request
    step = start_request(book, request, CHUNK + 20, store_end=CHUNK)
    request.num_computed_tokens = CHUNK + 20
    book.on_worker_output(worker_output(step, 0, CHUNK + 20))
    assert book.client.fetch(request.all_token_ids).result().num_hit_chunks == 0
    request.status = RequestStatus.FINISHED_ABORTED
    book.request_finished(request, None)  # an RL trainer aborting its batch: the engine may take no further step
    assert fetched_chunks(book.client, request.all_token_ids, 1) == 1


def test_batched_r3_is_what_the_request_computed_even_if_its_blocks_are_rewritten_before_the_send(batched_book):
    book = batched_book
    request = Request("rewritten", list(range(15000, 15000 + CHUNK + 3)))
    step = start_request(book, request, CHUNK + 3, store_end=CHUNK)
    request.num_computed_tokens = CHUNK + 3
    book.on_worker_output(worker_output(step, 0, CHUNK + 3))  # chunk 0 read from the mirror now
    # The request is preempted and another one computes into the same blocks before the batch is sent.
    book.mirror.forget_blocks(BLOCKS)
    book.mirror.write(slots(0, CHUNK), rows(0, CHUNK, salt=3))
    book.settle(10)
    assert fetched_chunks(book.client, request.all_token_ids, 1) == 1
    (chunk,) = decode_run(book.client.fetch(request.all_token_ids).result().objects, PROFILE, 0, CHUNK).chunks
    np.testing.assert_array_equal(chunk.rows, rows(0, CHUNK))


def generate_past_the_prompt(book: RoutedExpertsBook, request: Request, r3_server) -> int:
    """Run ``request`` (a prompt of ``CHUNK + 10`` tokens) to ``2 * CHUNK + 6``: chunk 0 (prompt tokens only) goes
    out once the batch steps passed; chunk 1 (the end of the prompt, then generated tokens) is read from the mirror
    at ``2 * CHUNK`` and then held for 3 steps. The server's store calls before it began."""
    calls_before = r3_server.status()["lmcache_r3"]["store_calls"]
    step = start_request(book, request, CHUNK + 10, store_end=CHUNK)
    request.num_computed_tokens = CHUNK + 10
    book.on_worker_output(worker_output(step, 0, CHUNK + 10))
    continue_request(book, request, CHUNK + 10, CHUNK + 12)
    continue_request(book, request, CHUNK + 12, CHUNK + 14)
    assert fetched_chunks(book.client, request.all_token_ids, 1) == 1  # the prompt's chunk: out after 2 steps
    continue_request(book, request, CHUNK + 14, 2 * CHUNK, store_end=2 * CHUNK)
    for start in range(2 * CHUNK, 2 * CHUNK + 6, 2):
        continue_request(book, request, start, start + 2)
    return calls_before


@pytest.mark.parametrize("batched_book", [2], indirect=True)
def test_r3_of_generated_tokens_waits_for_the_request_to_end_then_goes_out_in_its_last_step(batched_book, r3_server):
    book = batched_book
    request = Request("generating", list(range(19000, 19000 + 2 * CHUNK + 10)), num_prompt_tokens=CHUNK + 10)
    calls_before = generate_past_the_prompt(book, request, r3_server)
    # No request but this one could use chunk 1 yet: it waits past the batch steps.
    assert book.client.fetch(request.all_token_ids).result().num_hit_chunks == 1
    assert r3_server.status()["lmcache_r3"]["store_calls"] == calls_before + 1
    finish(book, request, "FINISHED_STOPPED")
    assert fetched_chunks(book.client, request.all_token_ids, 2) == 2  # its next turn finds it at once
    assert r3_server.status()["lmcache_r3"]["store_calls"] == calls_before + 2
    objects = book.client.fetch(request.all_token_ids).result().objects
    chunks = decode_run(objects, PROFILE, 0, CHUNK).chunks
    np.testing.assert_array_equal(np.concatenate([chunk.rows for chunk in chunks]), rows(0, 2 * CHUNK))


@pytest.mark.parametrize("batched_book", [2], indirect=True)
def test_r3_of_generated_tokens_goes_out_when_the_request_is_preempted(batched_book, r3_server):
    """A preempted request looks itself up again when it resumes: the R3 of what it generated must be there."""
    book = batched_book
    request = Request("preempted", list(range(21000, 21000 + 2 * CHUNK + 10)), num_prompt_tokens=CHUNK + 10)
    generate_past_the_prompt(book, request, r3_server)
    assert book.client.fetch(request.all_token_ids).result().num_hit_chunks == 1
    step = book.on_schedule(SchedulerOutput({}, preempted_req_ids={request.request_id}), 0)
    book.on_worker_output(R3WorkerMetadata(step=step))
    assert fetched_chunks(book.client, request.all_token_ids, 2) == 2
    objects = book.client.fetch(request.all_token_ids).result().objects
    chunks = decode_run(objects, PROFILE, 0, CHUNK).chunks
    np.testing.assert_array_equal(np.concatenate([chunk.rows for chunk in chunks]), rows(0, 2 * CHUNK))
