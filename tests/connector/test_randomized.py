"""Randomized hybrid schedules: vLLM's null block is never touched, and every forward pass reads the KV it would
have computed, whatever LMCache served.

Real parts only: the vLLM 0.32 scheduler, both roles of lmcache_r3's connector, a real LMCache server (default
flags and ``--separate-object-groups``; chunk 64, an fs L2 tier) and a hybrid KV config (attention + align-mode
Mamba, 32-token blocks). Each schedule draws a small block pool, a step budget of 32 or 64 tokens, and waves of
requests in flight together: random prompt lengths, prefixes shared with earlier prompts (chunk-aligned,
block-aligned and unaligned), decodes long enough to preempt, and prefix-cache resets between waves. Schedules are
drawn from ``random.Random(f"{seed}:{index}")``, so a failure names the seed and schedule that reproduce it.

The harness has no model, so the test plays one (:class:`ModelEmulator`, called between the connector's load and
save of every step). A forward pass over tokens ``[N0, N)`` writes each attention block it completes with bytes
derived from the tokens up to that block's end, and its recurrent state, bytes derived from ``tokens[:N]``, into
the block align mode keeps it in, ``(N - 1) // 32``. Before writing, it checks what a real model would read: every
full attention block below ``N0`` and the recurrent state at ``N0`` (block ``(N0 - 1) // 32``). Those bytes can
only come from the model itself, from vLLM's prefix cache or from an LMCache retrieve, so a missing, partial or
misplaced load, a restored null page and stale bytes are all mismatches; after every prefix-cache reset every block
but the null block is zeroed, so stale bytes cannot pass for a load.

After every wave: block 0 still holds its sentinel, the server holds no read lock, every request finished within a
bounded number of steps, the worker refused no operation naming the null block, and no read mismatched. At the end,
no object in the L2 tier holds null-page bytes, and the run retrieved for real (``--separate-object-groups``).
Set ``LMCACHE_R3_RANDOM_SCHEDULES`` to run more schedules per seed.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.connector.conftest import files_holding_the_null_page
from tests.connector.test_admission import wait_locks
from tests.support.harness import BLOCK_SIZE, NULL_SENTINEL
from tests.support.prompts import draw_prompt

pytestmark = pytest.mark.harness

OURS = "lmcache_r3.mp.connector"
CHUNK = 64
SCHEDULES_PER_SEED = int(os.environ.get("LMCACHE_R3_RANDOM_SCHEDULES", "16"))
MAX_STEPS_PER_WAVE = 3000
WAVE_TIMEOUT_S = 120.0
MAX_PROMPT = 256


# -- schedules --------------------------------------------------------------------------------------------------
@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    at_step: int
    origin: str

    def describe(self) -> str:
        origin = f"{len(self.prompt)} tokens ({self.origin})"
        return f"{self.rid}: {origin}, max_tokens {self.max_tokens}, at step {self.at_step}"


@dataclass
class Schedule:
    seed: int
    index: int
    num_blocks: int
    max_num_batched_tokens: int
    waves: list[list[Req]]
    reset_before: list[bool]

    def describe(self) -> str:
        lines = [
            f"seed {self.seed}, schedule {self.index}: num_blocks {self.num_blocks}, "
            f"max_num_batched_tokens {self.max_num_batched_tokens}"
        ]
        for w, wave in enumerate(self.waves):
            reset = ", after a prefix-cache reset and zeroing" if self.reset_before[w] else ""
            lines.append(f"  wave {w}{reset}:")
            lines.extend(f"    {r.describe()}" for r in wave)
        return "\n".join(lines)


def draw_schedule(seed: int, index: int) -> Schedule:
    """Waves of 1-4 requests; with a 64-token step budget, some waves are 3-4 long decodes that overflow the pool."""
    rng = random.Random(f"{seed}:{index}")
    num_blocks = rng.randint(24, 40)
    max_num_batched_tokens = rng.choice((32, 64))
    waves: list[list[Req]] = []
    earlier: list[Req] = []
    for w in range(rng.randint(3, 4)):
        # Align-mode Mamba prefills in whole blocks: only a 64-token budget lets a prefill run beside a decode.
        pressure = max_num_batched_tokens == 64 and rng.random() < 0.6
        wave = []
        for j in range(rng.randint(3, 4) if pressure else rng.randint(1, 4)):
            if pressure:
                prompt, origin = draw_prompt(rng, earlier, CHUNK, BLOCK_SIZE, max_len=192)
                max_tokens = rng.randint(128, 256)
            else:
                prompt, origin = draw_prompt(rng, earlier, CHUNK, BLOCK_SIZE, MAX_PROMPT)
                max_tokens = rng.randint(24, 160) if rng.random() < 0.4 else rng.randint(1, 6)
            at_step = 0 if j == 0 else rng.randint(0, 8)
            req = Req(f"s{index}w{w}r{j}", prompt, max_tokens, at_step, origin)
            wave.append(req)
            earlier.append(req)
        waves.append(wave)
    resets = [False] + [rng.random() < 0.5 for _ in waves[1:]]
    return Schedule(seed, index, num_blocks, max_num_batched_tokens, waves, resets)


# -- the model --------------------------------------------------------------------------------------------------
@dataclass
class Stats:
    schedules: int = 0
    waves: int = 0
    requests: int = 0
    steps: int = 0
    preemptions: int = 0
    resets: int = 0
    retrieves: int = 0
    failed_closed: int = 0
    stores_trimmed: int = 0
    partial_admissions: int = 0
    zero_admissions: int = 0
    loads_verified: int = 0
    loaded_blocks_verified: int = 0
    reads_checked: int = 0
    store_flushes: int = 0


class ModelEmulator:
    """Plays the model's forward pass: checks the KV it reads, writes the KV it computes (see the module doc)."""

    def __init__(self, harness, stats: Stats) -> None:
        self.harness = harness
        self.stats = stats
        self.attention = harness.attention_layers()
        self.recurrent = harness.recurrent_layers()
        self.null = harness.null_block_id
        self.violations: list[str] = []
        self.num_violations = 0
        self.step = 0
        self.pending_loads: dict[str, tuple[int, int]] = {}
        self._expected: dict[tuple[bytes, str], torch.Tensor] = {}

    # bytes the model computes for ``tokens`` (attention: a block ending there; recurrent: the state there)
    def expected(self, kind: bytes, tokens: Sequence[int], layer: str, size: int) -> torch.Tensor:
        digest = hashlib.blake2b(kind + array("q", tokens).tobytes(), digest_size=16).digest()
        key = (digest, layer)
        page = self._expected.get(key)
        if page is None:
            seed = int.from_bytes(hashlib.blake2b(digest + layer.encode(), digest_size=8).digest(), "little")
            page = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8))
            self._expected[key] = page
        return page

    def _violation(self, message: str) -> None:
        self.num_violations += 1
        if len(self.violations) < 12:
            self.violations.append(f"step {self.step}: {message}")

    def _check(self, rid: str, what: str, block: int | None, layers: list[str], kind: bytes, tokens) -> None:
        if block is None or block == self.null:
            self._violation(f"{rid} reads its {what} from {'no block' if block is None else 'the null block'}")
            return
        for layer in layers:
            page = self.harness.pages.page(layer, block)
            want = self.expected(kind, tokens, layer, page.numel())
            self.stats.reads_checked += 1
            if not torch.equal(page, want):
                if not bool(page.any()):
                    got = "zeros (nothing was loaded or computed there)"
                elif bool((page == NULL_SENTINEL).all()):
                    got = "the null page"
                else:
                    got = f"other bytes ({int((page != want).sum())} of {page.numel()} differ)"
                self._violation(f"{rid} reads its {what} from block {block}, layer {layer}: {got}")
                return

    def _write(self, rid: str, what: str, block: int | None, layers: list[str], kind: bytes, tokens) -> None:
        if block is None or block == self.null:
            self._violation(f"{rid} would write its {what} into {'no block' if block is None else 'the null block'}")
            return
        for layer in layers:
            page = self.harness.pages.page(layer, block)
            page.copy_(self.expected(kind, tokens, layer, page.numel()))

    def __call__(self, out) -> None:
        self.step += 1
        # What the worker submitted this step (it has already dropped any operation it refused).
        for entry in out.kv_connector_metadata.requests:
            if entry.direction == "RETRIEVE":
                self.pending_loads[entry.request_id] = (entry.op.start, entry.op.end)
        scheduler = self.harness.scheduler
        passes = []
        for rid, num_tokens in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            end = request.num_computed_tokens  # already advanced by schedule()
            tables = scheduler.kv_cache_manager.get_block_ids(rid)
            passes.append((rid, end - num_tokens, end, list(request.all_token_ids[:end]), tables))
        for rid, start, _, tokens, (attention, recurrent) in passes:  # every read before any write
            before = self.num_violations
            for i in range(start // BLOCK_SIZE):
                what = f"attention block {i}"
                self._check(rid, what, attention[i], self.attention, b"A", tokens[: (i + 1) * BLOCK_SIZE])
            if start > 0:
                i = (start - 1) // BLOCK_SIZE
                block = recurrent[i] if i < len(recurrent) else None
                self._check(rid, f"recurrent state at {start}", block, self.recurrent, b"R", tokens[:start])
            loaded = self.pending_loads.pop(rid, None)
            if loaded is not None and start >= loaded[1] and self.num_violations == before:
                self.stats.loads_verified += 1
                self.stats.loaded_blocks_verified += (loaded[1] - loaded[0]) // BLOCK_SIZE
        for rid, start, end, tokens, (attention, recurrent) in passes:
            for i in range(start // BLOCK_SIZE, end // BLOCK_SIZE):  # attention blocks this pass completes
                what = f"attention block {i}"
                block = attention[i] if i < len(attention) else None
                self._write(rid, what, block, self.attention, b"A", tokens[: (i + 1) * BLOCK_SIZE])
            i = (end - 1) // BLOCK_SIZE
            block = recurrent[i] if i < len(recurrent) else None
            self._write(rid, f"recurrent state at {end}", block, self.recurrent, b"R", tokens[:end])


# -- running a schedule -----------------------------------------------------------------------------------------
def run_wave(harness, wave: list[Req], stats: Stats) -> str | None:
    """Add the wave's requests at their steps and step until every request finished; the hang, if any."""
    arrivals = sorted(wave, key=lambda r: r.at_step)
    deadline = time.monotonic() + WAVE_TIMEOUT_S
    steps = 0
    while arrivals or harness.scheduler.has_requests() or harness.scheduler.requests:
        while arrivals and (arrivals[0].at_step <= steps or not harness.scheduler.requests):
            req = arrivals.pop(0)
            harness.add_request(req.rid, req.prompt, req.max_tokens)
        if steps >= MAX_STEPS_PER_WAVE or time.monotonic() > deadline:
            return f"requests {sorted(harness.scheduler.requests)} still unfinished after {steps} steps"
        out = harness.step()
        steps += 1
        stats.preemptions += len(out.preempted_req_ids or ())
        if not out.num_scheduled_tokens:
            time.sleep(0.002)  # waiting on a lookup, a load or a store; let the server progress
    stats.steps += steps
    return None


def describe_failure(schedule: Schedule, wave: int, harness, emulator: ModelEmulator, problems: list[str]) -> str:
    lines = ["; ".join(problems), schedule.describe(), f"failed in wave {wave}; block tables (attention, recurrent):"]
    for req in schedule.waves[wave]:
        first = harness.block_tables.get(req.rid)
        last = harness.final_block_tables.get(req.rid)
        lines.append(f"  {req.rid}: first scheduled {first}, last {last}")
    lines.append(f"scheduler connector counters: {harness.scheduler.connector.counters.values}")
    lines.append(f"worker connector counters: {harness.worker.counters.values}")
    lines.extend(f"  {v}" for v in emulator.violations)
    if emulator.num_violations > len(emulator.violations):
        lines.append(f"  ... {emulator.num_violations - len(emulator.violations)} more mismatches")
    return "\n".join(lines)


def run_schedule(factory, server, separate: bool, schedule: Schedule, stats: Stats) -> None:
    harness = factory(
        server=server,
        kind="hybrid",
        connector_module=OURS,
        extra_config={"lmcache_r3.separate_object_groups": separate},
        num_blocks=schedule.num_blocks,
        max_num_batched_tokens=schedule.max_num_batched_tokens,
    )
    emulator = ModelEmulator(harness, stats)
    harness.forward_hook = emulator
    for w, wave in enumerate(schedule.waves):
        if schedule.reset_before[w]:
            harness.reset_prefix_cache()
            harness.zero_all_blocks_but_null()
            stats.resets += 1
        hang = run_wave(harness, wave, stats)
        problems = [hang] if hang else []
        changed = harness.null_block_changed_bytes()
        if changed:
            problems.append(f"{changed} bytes of the null block changed")
        locks = wait_locks(server, 0)
        if locks:
            problems.append(f"{locks} objects still read-locked on the server")
        if harness.scheduler.requests:
            problems.append(f"requests left in the scheduler: {sorted(harness.scheduler.requests)}")
        refused = harness.worker.counters.values["null_block_ops_refused"]
        if refused:
            problems.append(f"the scheduler sent {refused} operations naming the null block (the worker refused them)")
        if emulator.num_violations:
            problems.append(f"{emulator.num_violations} forward-pass reads did not see the KV the model computes")
        assert not problems, describe_failure(schedule, w, harness, emulator, problems)
        stats.waves += 1
        stats.requests += len(wave)
    counters = harness.scheduler.connector.counters.values
    stats.retrieves += counters["retrieves"]
    stats.failed_closed += counters["retrieves_failed_closed"]
    stats.stores_trimmed += counters["stores_trimmed_at_null_block"]
    stats.partial_admissions += counters["partial_admissions"]
    stats.zero_admissions += counters["zero_admissions"]
    stats.store_flushes += counters["store_flushes_before_block_reuse"]
    stats.schedules += 1


@pytest.mark.parametrize("seed", [0, 1], ids=lambda s: f"seed{s}")
def test_random_hybrid_schedules_keep_block_0_intact_and_every_forward_pass_reads_the_kv_it_computed(
    scheduler_harness_factory, hybrid_server, seed
):
    server, separate, l2 = hybrid_server
    assert wait_locks(server, 0) == 0, "an earlier test left read locks on this server"
    stats = Stats()
    started = time.monotonic()
    for index in range(SCHEDULES_PER_SEED):
        run_schedule(scheduler_harness_factory, server, separate, draw_schedule(seed, index), stats)
    time.sleep(0.2)  # let the L2 tier finish writing what L1 stored
    assert files_holding_the_null_page(l2) == [], "stored objects hold the null page"
    variant = "--separate-object-groups" if separate else "default flags"
    print(
        f"\nrandomized hybrid, {variant}, seed {seed}: {stats.schedules} schedules, {stats.waves} waves, "
        f"{stats.requests} requests, {stats.steps} steps, {stats.preemptions} preemptions, {stats.resets} resets; "
        f"retrieves {stats.retrieves} ({stats.loads_verified} loads / {stats.loaded_blocks_verified} blocks verified "
        f"byte-equal), failed closed {stats.failed_closed}, stores trimmed {stats.stores_trimmed}, partial admissions "
        f"{stats.partial_admissions}, zero admissions {stats.zero_admissions}, store flushes before block reuse "
        f"{stats.store_flushes}; {stats.reads_checked} page reads checked in {time.monotonic() - started:.1f} s"
    )
    assert stats.preemptions > 0, "no schedule preempted a request"
    assert stats.retrieves + stats.failed_closed > 0, "no schedule ever hit LMCache: the run proves nothing"
    if separate:
        assert stats.retrieves > 0 and stats.loads_verified > 0, "no retrieve was carried out and verified"
