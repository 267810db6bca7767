"""A cache hit is the joint hit: the leading chunks whose KV *and* R3 are both in the server."""

import time

import numpy as np
import pytest

from lmcache_r3.artifacts import R3Profile, encode_run
from lmcache_r3.mp.r3_client import R3Client, joint_hit_tokens
from tests.support.harness import kv_lookup_answer, wait_locks

pytestmark = [pytest.mark.server, pytest.mark.harness]

CHUNK = 64
PROFILE = R3Profile(num_layers=2, top_k=2, num_experts=8)


@pytest.mark.parametrize(
    ("kv_hit", "r3_chunks", "start", "joint"),
    [
        pytest.param(256, 4, 0, 256, id="both-complete"),
        pytest.param(256, 2, 0, 128, id="r3-shorter"),
        pytest.param(128, 4, 0, 128, id="kv-shorter"),
        pytest.param(256, 0, 0, 0, id="no-r3"),
        pytest.param(256, 1, 128, 192, id="r3-counted-from-a-later-chunk"),
        pytest.param(0, 3, 0, 0, id="no-kv"),
    ],
)
def test_joint_hit_is_the_shorter_of_the_two_prefixes(kv_hit, r3_chunks, start, joint):
    assert joint_hit_tokens(kv_hit, r3_chunks, CHUNK, start=start) == joint


def kv_hit_tokens(harness, request_id: str, tokens: list[int]) -> int:
    """The stock KV lookup of the scheduler-side connector (locks released right after)."""
    adapter = harness.scheduler.connector.scheduler_adapter
    adapter.maybe_submit_lookup_request(request_id, tokens)
    hit = kv_lookup_answer(adapter, request_id)
    adapter.free_lookup_locks(tokens, 0, hit, request_id)
    adapter.cleanup_lookup_result(request_id)
    adapter.end_session(request_id)
    return hit


def test_deleting_r3_alone_shrinks_the_joint_hit(own_r3_server, scheduler_harness_factory):
    r3_server = own_r3_server
    harness = scheduler_harness_factory(kind="dense", server=r3_server)
    model_name = harness.scheduler.connector.scheduler_adapter.model_name
    tokens = [10 + (7 * i) % 900 for i in range(4 * CHUNK + 3)]
    harness.generate([("A", tokens)])
    kv_hit = kv_hit_tokens(harness, "probe-1", tokens)
    assert kv_hit == 4 * CHUNK

    rows = np.random.default_rng(0).integers(0, 8, size=(4 * CHUNK, 2, 2)).astype(np.uint8)
    with R3Client(r3_server.url, model_name, PROFILE) as r3:
        r3.store(tokens, 0, encode_run(PROFILE, 0, rows, CHUNK), end=4 * CHUNK).result()
        deadline = time.monotonic() + 10
        while (r3_hit := r3.lookup(tokens).result().num_hit_chunks) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert joint_hit_tokens(kv_hit, r3_hit, CHUNK) == 4 * CHUNK

        deleted = r3.delete(tokens, start=2 * CHUNK, end=3 * CHUNK).result()
        assert deleted.num_deleted == 1
        r3_hit = r3.lookup(tokens).result().num_hit_chunks
        assert r3_hit == 2
        assert kv_hit_tokens(harness, "probe-2", tokens) == 4 * CHUNK, "deleting R3 must leave the KV alone"
        assert joint_hit_tokens(kv_hit, r3_hit, CHUNK) == 2 * CHUNK
    assert wait_locks(r3_server, 0) == 0  # LMCache releases lookup locks with a message it does not wait for
