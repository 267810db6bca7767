"""Sliding-window models (full attention + a sliding-window group): vLLM frees a request's blocks as its window
passes them, in mid-request, and can hand them out in the same step; no stored object may hold bytes written after
its store was submitted, and block 0 is never touched.

Real parts: the vLLM 0.32 scheduler, both roles of lmcache_r3's connector and a real LMCache server with an fs L2
tier whose files the test scans. The only fake is the model (the harness plays it).
"""

import os
import signal
import threading
import time

import pytest

from tests.connector.conftest import CHUNK, files_holding, tier_files
from tests.connector.test_admission import wait_locks
from tests.support.harness import BLOCK_SIZE, SLIDING_WINDOW

pytestmark = pytest.mark.harness

OURS = "lmcache_r3.mp.connector"
LATE = 0xCD
"""Byte the emulated forward pass writes into the blocks it computes after the first step."""
LATE_RUN = bytes([LATE]) * 256


@pytest.fixture
def own_server(lmcache_server_factory, tmp_path):
    """A server of this test's own (it is paused), chunk 64, with an fs L2 tier: ``(server, l2_dir)``. Ask for it
    before ``scheduler_harness_factory``, so the harness is shut down before the server stops."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    server = lmcache_server_factory(chunk_size=CHUNK, l2_adapters=({"type": "fs", "base_path": str(l2)},))
    yield server, l2
    server.stop()


def wait_tier_files(l2, minimum: int, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while len(files := tier_files(l2)) < minimum and time.monotonic() < deadline:
        time.sleep(0.05)
    return files


def test_blocks_the_window_passed_are_not_written_while_the_server_still_reads_their_store(
    own_server, scheduler_harness_factory
):
    """A 3-chunk prompt fills the whole block pool in one step and submits the stores of its 3 chunks. The server
    is paused before it copies them. The next step's decode slides the window: vLLM frees the oldest window blocks
    and hands two of them back to the same request for its new token. The connector must have the worker wait for
    the in-flight stores before that forward pass writes them; otherwise the server, resumed, copies the new token's
    bytes into the stored chunks."""
    server, l2 = own_server
    prompt_tokens = 3 * CHUNK
    blocks_per_group = prompt_tokens // BLOCK_SIZE
    harness = scheduler_harness_factory(
        server=server,
        kind="sliding",
        connector_module=OURS,
        num_blocks=1 + 2 * blocks_per_group,  # the null block and the prompt's blocks: nothing else is free
        max_num_batched_tokens=prompt_tokens,
        mq_timeout_s=10.0,
    )
    written: list[list[int]] = []
    """Per step that computed A, the blocks it wrote."""
    # With the flush the decode waits for the stores, so only this timer resumes the server; without it the decode
    # resumes the server itself once it wrote its bytes, and the server then copies them.
    resume = threading.Timer(3.0, lambda: os.kill(server.pid, signal.SIGCONT))

    def forward(out) -> None:
        if "A" not in out.num_scheduled_tokens:
            return
        work = harness._computing["A"]
        tables = harness.scheduler.kv_cache_manager.get_block_ids("A")
        blocks = sorted({ids[p // BLOCK_SIZE] for ids in tables for p in range(work.start, work.end)})
        if written:
            for layer in harness.pages.regions:
                for block in blocks:
                    harness.pages.page(layer, block).fill_(LATE)
            os.kill(server.pid, signal.SIGCONT)
        else:
            # The prompt's stores are submitted after this forward pass; the server copies none until resumed.
            os.kill(server.pid, signal.SIGSTOP)
            resume.start()
        written.append(blocks)

    harness.forward_hook = forward
    harness.add_request("A", [10 + (13 * i + 3) % 1000 for i in range(prompt_tokens)], max_tokens=3)
    try:
        harness.step_until_scheduled("A")
        harness.run_until_idle()
    finally:
        resume.cancel()
        os.kill(server.pid, signal.SIGCONT)
    first = harness.block_tables["A"]
    assert len(written) >= 2, written
    reused = set(written[1]) & {b for ids in first for b in ids}
    assert reused, f"the scenario needs the decode to reuse a stored block: it wrote {written[1]}, prompt {first}"
    files = wait_tier_files(l2, 3)
    assert len(files) >= 3, f"A's 3 chunks should have reached the fs tier: {files}"
    assert files_holding(l2, LATE_RUN) == [], "a stored chunk holds bytes written after its store was submitted"
    assert harness.scheduler.connector.counters.values["store_flushes_before_block_reuse"] >= 1
    assert harness.null_block_changed_bytes() == 0
    assert wait_locks(server, 0) == 0


def test_a_sliding_window_prefix_loads_from_lmcache_with_separate_object_groups_and_never_touches_block_0(
    scheduler_harness_factory, hybrid_server
):
    """A request's 3-chunk prompt is stored; after vLLM's prefix cache reset (and every block zeroed), a request
    extending it hits LMCache. With ``--separate-object-groups`` it loads every attention block and the window
    group's blocks of the last chunk (the window) byte-equal; by default LMCache would write the window group's
    null blocks, so the retrieve fails closed and the prompt is recomputed. Either way block 0 keeps its sentinel
    and no lock is left."""
    server, separate, _ = hybrid_server
    harness = scheduler_harness_factory(
        server=server,
        kind="sliding",
        connector_module=OURS,
        extra_config={"lmcache_r3.separate_object_groups": separate},
    )
    prompt = [10 + (29 * i + 11) % 1000 for i in range(3 * CHUNK)]
    harness.generate([("A", prompt)])
    attention, windowed = harness.block_tables["A"]
    stored_attention = harness.attention_bytes(attention)
    stored_window = harness.group_bytes(1, windowed[-SLIDING_WINDOW // BLOCK_SIZE :])
    harness.reset_prefix_cache()
    harness.zero_all_blocks_but_null()

    harness.generate([("C", prompt + [7] * 20)])
    counters = harness.scheduler.connector.counters.values
    attention_c, windowed_c = harness.block_tables["C"]
    window_c = windowed_c[len(prompt) // BLOCK_SIZE - SLIDING_WINDOW // BLOCK_SIZE : len(prompt) // BLOCK_SIZE]
    if separate:
        assert harness.null_block_id in windowed_c, "the window group got real blocks for the passed positions"
        assert counters["retrieves_failed_closed"] == 0
        assert harness.attention_bytes(attention_c[: len(prompt) // BLOCK_SIZE]) == stored_attention
        assert harness.group_bytes(1, window_c) == stored_window
    else:  # C's blocks were reallocated for the recomputation: only the refusal is left to check
        assert counters["retrieves_failed_closed"] == 1
    assert harness.null_block_changed_bytes() == 0
    assert wait_locks(server, 0) == 0
