"""Randomized routed-experts schedules: every request returns the router's rows, and every R3 chunk the server
serves is the router's rows of its tokens, whatever mix of sources served them.

Real parts: the vLLM 0.32 scheduler (synchronous, or async as on a GPU), both roles of lmcache_r3's connector and a
real LMCache server with the R3 chunk type (chunk 64, its own for this test). The model cannot run in a scheduler
test: :class:`tests.support.harness.EmulatedRouter` stands in for its routers (a pure function of the token
prefix), and the worker-side connector maps its rows as it maps a real capture buffer.

Each schedule draws a block pool (some small enough to preempt), a step budget (chunked prefill), async scheduling
or not, speculative drafts or not (the harness proposes them, one in three wrong), whether decode-phase chunks are
stored, and waves of requests: prompts fresh or sharing a prefix with an earlier one (chunk-aligned, block-aligned
and unaligned), short and long decodes, some ending early on a stop token, some aborted while they run. Before a
wave, vLLM's prefix cache may be reset (so LMCache serves the shared prefixes) and the R3 of an earlier request's
tail may be deleted from the server while its KV stays (so the joint hit shrinks). Schedules are drawn from
``random.Random(f"{seed}:{index}")``: a failure names the seed and schedule that reproduce it.

After every wave: every request finished within a bounded number of steps; each one that was not aborted returned
exactly the router's rows of its prompt and output tokens (and says which tokens they are); an aborted one returned
none; the server holds no read lock and no session. After every schedule: for every request's tokens, each R3 chunk
the server serves equals the router's rows of those tokens (nothing wrong was ever published: not a rejected draft's
row, not a chunk of an aborted request, not a chunk stored beside another request's KV).
Set ``LMCACHE_R3_RANDOM_SCHEDULES`` to run more schedules per seed.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from lmcache_r3.artifacts import decode_run
from lmcache_r3.mp.r3_client import R3Client
from lmcache_r3.output import FINGERPRINT_KEY, ROUTED_EXPERTS_ERROR_KEY, ROUTED_EXPERTS_KEY, decode_routed_experts
from tests.support.harness import BLOCK_SIZE, ask_until_answered, wait_locks, wait_sessions
from tests.support.prompts import draw_prompt

pytestmark = [pytest.mark.server, pytest.mark.harness]

CONNECTOR = "lmcache_r3.mp.connector"
CHUNK = 64
SCHEDULES_PER_SEED = int(os.environ.get("LMCACHE_R3_RANDOM_SCHEDULES", "12"))
MAX_PROMPT = 256
MAX_STEPS_PER_WAVE = 4000
WAVE_TIMEOUT_S = 120.0


# -- schedules --------------------------------------------------------------------------------------------------
@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    at_step: int
    origin: str
    stop_after: int | None = None
    """The output index (from 0) that samples the stop token, ending the request there."""
    abort_after: int | None = None
    """Steps after its arrival at which the test aborts it, if it is still running then."""

    @property
    def num_outputs(self) -> int:
        """Output tokens it produces when it runs to its end."""
        return self.max_tokens if self.stop_after is None else self.stop_after + 1

    def describe(self) -> str:
        ends = f", stop token at output {self.stop_after}" if self.stop_after is not None else ""
        ends += f", aborted {self.abort_after} steps after arrival" if self.abort_after is not None else ""
        return f"{self.rid}: {len(self.prompt)} tokens ({self.origin}), max_tokens {self.max_tokens}{ends}, " \
               f"at step {self.at_step}"  # fmt: skip


@dataclass
class Wave:
    requests: list[Req]
    reset_before: bool
    delete_before: tuple[str, int] | None
    """(request id, first chunk): the R3 of that earlier request's tokens from that chunk on is deleted first."""
    together: bool = False
    """Every request arrives at once and is admitted together (its lookup answered first), as a batch of long
    decodes that a small pool cannot hold: vLLM preempts."""


@dataclass
class Schedule:
    seed: int
    index: int
    num_blocks: int
    max_num_batched_tokens: int
    async_scheduling: bool
    num_speculative_tokens: int
    save_decode_cache: bool
    waves: list[Wave] = field(default_factory=list)

    def describe(self) -> str:
        lines = [
            f"seed {self.seed}, schedule {self.index}: num_blocks {self.num_blocks}, max_num_batched_tokens "
            f"{self.max_num_batched_tokens}, async scheduling {self.async_scheduling}, speculative tokens "
            f"{self.num_speculative_tokens}, save_decode_cache {self.save_decode_cache}"
        ]
        for w, wave in enumerate(self.waves):
            before = [" after a prefix-cache reset" if wave.reset_before else ""]
            if wave.delete_before:
                before.append(f" after deleting the R3 of {wave.delete_before[0]} from chunk {wave.delete_before[1]}")
            together = ", admitted together" if wave.together else ""
            lines.append(f"  wave {w}{','.join(before)}{together}:")
            lines.extend(f"    {r.describe()}" for r in wave.requests)
        return "\n".join(lines)


def draw_schedule(seed: int, index: int) -> Schedule:
    rng = random.Random(f"{seed}:{index}")
    speculative = rng.random() < 0.3
    schedule = Schedule(
        seed,
        index,
        num_blocks=0,  # drawn below, once the waves are known
        max_num_batched_tokens=rng.choice((32, 48, 64, 256)),
        async_scheduling=rng.random() < 0.4,
        num_speculative_tokens=3 if speculative else 0,
        save_decode_cache=speculative or rng.random() < 0.5,
    )
    earlier: list[Req] = []
    for w in range(rng.randint(3, 4)):
        pressure = rng.random() < 0.35  # several long decodes at once: a small pool preempts
        requests = []
        for j in range(rng.randint(3, 4) if pressure else rng.randint(1, 4)):
            prompt, origin = draw_prompt(rng, earlier, CHUNK, BLOCK_SIZE, 160 if pressure else MAX_PROMPT)
            if pressure:
                max_tokens = rng.randint(60, 100)
            else:
                max_tokens = rng.randint(24, 100) if rng.random() < 0.4 else rng.randint(1, 6)
            at_step = 0 if j == 0 or pressure else rng.randint(0, 8)
            req = Req(f"s{index}w{w}r{j}", prompt, max_tokens, at_step, origin)
            if max_tokens > 1 and rng.random() < 0.2:
                req.stop_after = rng.randint(0, max_tokens - 2)
            if rng.random() < 0.15:
                req.abort_after = rng.randint(1, 40)
            requests.append(req)
        deletable = [r for r in earlier if len(r.prompt) + r.num_outputs > 2 * CHUNK and r.abort_after is None]
        delete = None
        if deletable and rng.random() < 0.3:
            source = rng.choice(deletable)
            delete = (source.rid, rng.randint(0, (len(source.prompt) + source.num_outputs - 1) // CHUNK - 1))
        reset = w > 0 and rng.random() < 0.6
        schedule.waves.append(Wave(requests, reset_before=reset, delete_before=delete, together=pressure))
        earlier.extend(requests)
    # 14 blocks (13 usable): one request of 256 + 100 tokens fits; a wave admitted together overflows 14-20.
    together = any(wave.together for wave in schedule.waves)
    schedule.num_blocks = rng.randint(14, 20) if together else rng.randint(14, 40)
    return schedule


# -- running a schedule -----------------------------------------------------------------------------------------
@dataclass
class Stats:
    schedules: int = 0
    requests: int = 0
    steps: int = 0
    preemptions: int = 0
    aborted: int = 0
    stopped: int = 0
    resets: int = 0
    deletions: int = 0
    rows_checked: int = 0
    chunks_checked: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    def add_counters(self, values: dict[str, int]) -> None:
        for name, value in values.items():
            self.counters[name] = self.counters.get(name, 0) + value


def run_wave(harness, wave: Wave, stats: Stats) -> tuple[set[str], str | None]:
    """Add the wave's requests at their steps, abort those due, step until all finished: (aborted ids, hang)."""
    from vllm.v1.request import RequestStatus

    arrivals = sorted(wave.requests, key=lambda r: r.at_step)
    arrived: dict[str, int] = {}
    aborted: set[str] = set()
    deadline = time.monotonic() + WAVE_TIMEOUT_S
    steps = 0
    if wave.together:
        # A harness step takes microseconds and a lookup milliseconds: admitted one by one as their lookups
        # answer, the first would finish before the last started.
        for req in arrivals:
            harness.add_request(req.rid, req.prompt, req.max_tokens, stop_after=req.stop_after)
            arrived[req.rid] = 0
        ask_until_answered(harness, [req.rid for req in arrivals])
        arrivals = []
    while arrivals or harness.busy():
        while arrivals and (arrivals[0].at_step <= steps or not harness.busy()):
            req = arrivals.pop(0)
            harness.add_request(req.rid, req.prompt, req.max_tokens, stop_after=req.stop_after)
            arrived[req.rid] = steps
        for req in wave.requests:
            due = req.abort_after is not None and req.rid in arrived and steps - arrived[req.rid] >= req.abort_after
            if due and req.rid not in aborted and req.rid not in harness.outputs:
                if req.rid in harness.scheduler.requests:
                    harness.scheduler.finish_requests(req.rid, RequestStatus.FINISHED_ABORTED)
                    aborted.add(req.rid)
        if steps >= MAX_STEPS_PER_WAVE or time.monotonic() > deadline:
            return aborted, f"requests {sorted(harness.scheduler.requests)} still unfinished after {steps} steps"
        out = harness.step()
        steps += 1
        stats.preemptions += len(out.preempted_req_ids or ())
        if not out.num_scheduled_tokens:
            time.sleep(0.002)  # waiting on a lookup, a load or a store; let the server progress
    stats.steps += steps
    return aborted, None


def wave_problems(harness, server, wave: Wave, aborted: set[str], stats: Stats) -> list[str]:
    """What the wave got wrong: rows, locks, sessions, leftover requests."""
    problems = []
    dtype = harness.scheduler.connector.r3_profile.dtype
    for req in wave.requests:
        params = harness.outputs.get(req.rid) or {}
        if req.rid in aborted:
            if ROUTED_EXPERTS_KEY in params:
                problems.append(f"{req.rid} was aborted but returned routed experts")
            continue
        if ROUTED_EXPERTS_KEY not in params:
            problems.append(f"{req.rid} returned no routed experts: {params.get(ROUTED_EXPERTS_ERROR_KEY, params)}")
            continue
        sequence = harness.sequence(req.rid, req.prompt, req.num_outputs)
        rows = decode_routed_experts(params[ROUTED_EXPERTS_KEY])
        expected = harness.router.routed_experts(sequence, dtype)
        if not params[FINGERPRINT_KEY].startswith(f"{len(sequence)}:"):
            problems.append(f"{req.rid}: rows for {params[FINGERPRINT_KEY]}, expected {len(sequence)} tokens")
        elif rows.shape != expected.shape:
            problems.append(f"{req.rid}: rows {rows.shape}, expected {expected.shape}")
        elif not np.array_equal(rows, expected):
            wrong = np.flatnonzero((rows != expected).any(axis=(1, 2)))
            problems.append(f"{req.rid}: {wrong.size} rows differ from the router's, first at position {wrong[0]}")
        stats.rows_checked += rows.shape[0]
        stats.stopped += req.stop_after is not None
    stats.aborted += len(aborted)
    if harness.scheduler.requests:
        problems.append(f"requests left in the scheduler: {sorted(harness.scheduler.requests)}")
    if locks := wait_locks(server, 0):
        problems.append(f"{locks} objects still read-locked on the server")
    if sessions := wait_sessions(server, 0):
        problems.append(f"{sessions} sessions still open on the server")
    return problems


def served_chunk_problems(harness, server, schedule: Schedule, stats: Stats) -> list[str]:
    """Every R3 chunk the server serves for any request's tokens (prompt and every output it could have produced)
    must be the router's rows of those tokens."""
    connector = harness.scheduler.connector
    profile = connector.r3_profile
    problems = []
    with R3Client(server.url, connector.scheduler_adapter.model_name, profile) as client:
        for wave in schedule.waves:
            for req in wave.requests:
                sequence = harness.sequence(req.rid, req.prompt, req.num_outputs)
                fetched = client.fetch(sequence).result()
                decoded = decode_run(fetched.objects, profile, 0, CHUNK)
                if decoded.error is not None or len(decoded.chunks) != fetched.num_hit_chunks:
                    problems.append(f"{req.rid}: the server served R3 objects that do not decode: {decoded.error}")
                for i, chunk in enumerate(decoded.chunks):
                    expected = harness.router.rows(sequence, i * CHUNK, (i + 1) * CHUNK).astype(profile.dtype)
                    stats.chunks_checked += 1
                    if not np.array_equal(chunk.rows, expected):
                        problems.append(f"{req.rid}: the server's R3 chunk {i} is not the router's rows of its tokens")
    return problems


def delete_r3(harness, server, schedule: Schedule, rid: str, first_chunk: int) -> None:
    source = next(r for wave in schedule.waves for r in wave.requests if r.rid == rid)
    sequence = harness.sequence(rid, source.prompt, source.num_outputs)
    connector = harness.scheduler.connector
    with R3Client(server.url, connector.scheduler_adapter.model_name, connector.r3_profile) as client:
        client.delete(sequence, first_chunk * CHUNK).result()


def run_schedule(factory, server, schedule: Schedule, stats: Stats) -> None:
    harness = factory(
        server=server,
        connector_module=CONNECTOR,
        routed_experts=True,
        num_blocks=schedule.num_blocks,
        max_num_batched_tokens=schedule.max_num_batched_tokens,
        async_scheduling=schedule.async_scheduling,
        num_speculative_tokens=schedule.num_speculative_tokens,
        extra_config={"lmcache.mp.save_decode_cache": schedule.save_decode_cache},
    )
    for w, wave in enumerate(schedule.waves):
        if wave.reset_before:
            harness.reset_prefix_cache()
            stats.resets += 1
        if wave.delete_before:
            harness.settle_stores()
            delete_r3(harness, server, schedule, *wave.delete_before)
            stats.deletions += 1
        aborted, hang = run_wave(harness, wave, stats)
        problems = [hang] if hang else []
        problems += wave_problems(harness, server, wave, aborted, stats)
        assert not problems, f"{'; '.join(problems)}\nfailed in wave {w} of\n{schedule.describe()}"
        stats.requests += len(wave.requests)
    harness.settle_stores()
    problems = served_chunk_problems(harness, server, schedule, stats)
    assert not problems, f"{'; '.join(problems)}\nafter\n{schedule.describe()}"
    stats.add_counters(harness.scheduler.connector.routed.counters.values)
    stats.add_counters({"drafts_rejected": harness.drafts_rejected})
    stats.schedules += 1


@pytest.mark.parametrize("seed", [0, 1], ids=lambda s: f"seed{s}")
def test_random_schedules_return_the_routers_rows_and_the_server_serves_only_the_routers_rows(
    own_r3_server, scheduler_harness_factory, seed
):  # the server first: it is stopped after the harnesses (a connector shut down after its server waits for it)
    stats = Stats()
    started = time.monotonic()
    for index in range(SCHEDULES_PER_SEED):
        run_schedule(scheduler_harness_factory, own_r3_server, draw_schedule(seed, index), stats)
    counters = stats.counters
    print(
        f"\nrandomized routed experts, seed {seed}: {stats.schedules} schedules, {stats.requests} requests "
        f"({stats.aborted} aborted, {stats.stopped} ended on a stop token), {stats.steps} steps, "
        f"{stats.preemptions} preemptions, {stats.resets} resets, {stats.deletions} R3 deletions; "
        f"{stats.rows_checked} returned rows and {stats.chunks_checked} served chunks checked; rows from LMCache "
        f"{counters['rows_from_lmcache']}, from vLLM's prefix cache {counters['rows_from_prefix_cache']}, chunks "
        f"published {counters['chunks_published']}, joint hits shrunk {counters['joint_hits_shrunk']}, drafts "
        f"rejected {counters['drafts_rejected']}, in {time.monotonic() - started:.1f} s"
    )
    # The schedules must have exercised what they are meant to: else the run proves little.
    assert counters["rows_from_lmcache"] > 0, "no request was served routed experts from LMCache"
    assert counters["rows_from_prefix_cache"] > 0, "no request was served routed experts from vLLM's prefix cache"
    assert stats.preemptions > 0, "no schedule preempted a request"
    assert stats.aborted > 0, "no request was aborted while it ran"
    assert stats.chunks_checked > 0, "the server served no R3 chunk to check"
