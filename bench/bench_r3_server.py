"""What routed experts add to a prompt's cache traffic on one LMCache MP server, measured in the same run.

For the chunks of one prompt (default: 32k tokens of a 48-layer, top-8, 128-expert model, i.e. 12 MiB of R3),
the stock KV store + lookup + retrieve of the same chunks (default KV: 48 layers x 4 KV heads x head 128, bf16 =
96 KiB per token, the shape of Qwen3-30B-A3B) against the R3 store + fetch, on one server started here with the
R3 module loaded. The ratio is R3 time / KV time.

It also answers whether the R3 *lookup* should return the objects in the same round trip: it times a
count-only lookup followed by a fetch against a fetch alone.

    python bench/bench_r3_server.py [--tokens 32768] [--repeats 5] [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zmq
from benchdocs import write_section
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)
from lmcache.v1.multiprocess.group_view import EngineGroupInfo

from lmcache_r3.artifacts import R3Profile, decode_run, encode_run
from lmcache_r3.launch import TELEMETRY_OFF, exit_on_sigterm, free_port
from lmcache_r3.mp.r3_client import R3Client
from lmcache_r3.mp.server_process import r3_server_module_spec, start_loopback_server, start_server
from lmcache_r3.tiers.plugins import l2_adapter_spec

SECTION = "## R3 in the LMCache MP server"
HOT_REQUESTS = 8
CHUNK = 256
BLOCK = 64
MODEL = "bench-model"


def kv_setup(url: str, num_tokens: int, layers: int, heads: int, head_dim: int):
    context = zmq.Context()
    strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1)
    extra = {"lmcache.mp.mp_transfer_mode": "lmcache_driven", "lmcache.mp.mq_timeout": 120.0}
    scheduler = LMCacheMPSchedulerAdapter([url], context, MODEL, BLOCK, strategy, extra_config=extra)
    worker = LMCacheMPWorkerAdapter(url, context, MODEL, BLOCK, strategy, extra_config=extra)
    num_blocks = num_tokens // BLOCK
    generator = torch.Generator().manual_seed(0)
    kv_caches = {
        f"model.layers.{i}.self_attn": torch.randint(
            -100, 100, (2, num_blocks, BLOCK, heads, head_dim), dtype=torch.int16, generator=generator
        ).view(torch.bfloat16)
        for i in range(layers)
    }
    groups = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(layers)), tokens_per_block=BLOCK)]
    worker.register_kv_caches(kv_caches, engine_group_infos=groups, layout_hints={"kv_layout": "NHD"})
    nbytes = sum(t.numel() * t.element_size() for t in kv_caches.values())
    return scheduler, worker, list(range(num_blocks)), nbytes


def kv_round(scheduler, worker, blocks, tokens, tag: str) -> tuple[float, float]:
    """Store the prompt's KV, then look it up and retrieve it; returns (store s, lookup + retrieve s)."""
    started = time.perf_counter()
    worker.submit_store_request(tag, LoadStoreOp(tokens, [blocks], 0, len(tokens)), worker.create_recorded_event())
    assert worker.store_futures[tag].result(timeout=300)
    deadline = time.monotonic() + 120
    while True:  # stores commit asynchronously; count the time until the KV is visible
        if time.monotonic() > deadline:
            raise TimeoutError(f"KV of {tag} not visible after 120 s (L1 too small?)")
        scheduler.maybe_submit_lookup_request(tag + "-l", tokens)
        while (hit := scheduler.check_lookup_result(tag + "-l")) is None:
            time.sleep(0.0002)
        if hit == len(tokens):
            break
        scheduler.free_lookup_locks(tokens, 0, hit, tag + "-l")
        scheduler.cleanup_lookup_result(tag + "-l")
        scheduler.end_session(tag + "-l")
    store_s = time.perf_counter() - started
    scheduler.free_lookup_locks(tokens, 0, hit, tag + "-l")
    scheduler.cleanup_lookup_result(tag + "-l")
    scheduler.end_session(tag + "-l")
    started = time.perf_counter()
    scheduler.maybe_submit_lookup_request(tag + "-r", tokens)
    while (hit := scheduler.check_lookup_result(tag + "-r")) is None:
        time.sleep(0.0002)
    worker.submit_retrieve_request(tag + "-r", LoadStoreOp(tokens, [blocks], 0, hit), worker.create_recorded_event())
    assert worker.retrieve_futures[tag + "-r"][0].result(timeout=300)
    retrieve_s = time.perf_counter() - started
    scheduler.cleanup_lookup_result(tag + "-r")
    scheduler.end_session(tag + "-r")
    return store_s, retrieve_s


def clear_when_unlocked(server, timeout_s: float = 60.0) -> None:
    """Drop L1 once the last retrieve has released its read locks (they are released asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while server.l1_counts()["read_locked_count"] and time.monotonic() < deadline:
        time.sleep(0.01)
    server.clear_l1()
    if server.l1_counts()["total_object_count"]:
        raise RuntimeError(f"L1 still holds objects after clear: {server.l1_counts()}")


def r3_round(r3: R3Client, profile: R3Profile, tokens, rows) -> tuple[float, float]:
    """Encode + store the prompt's R3; then fetch + decode it. Returns (store s, fetch s).

    The module commits a store before it answers, so the store's round trip is the time until it is visible
    (checked, untimed, right after).
    """
    started = time.perf_counter()
    r3.store(tokens, 0, encode_run(profile, 0, rows, CHUNK)).result()
    store_s = time.perf_counter() - started
    assert r3.lookup(tokens).result().num_hit_chunks == len(tokens) // CHUNK, "store not visible on return"
    started = time.perf_counter()
    fetched = r3.fetch(tokens).result()
    decoded = decode_run(fetched.objects, profile, 0, CHUNK)
    fetch_s = time.perf_counter() - started
    assert decoded.error is None and len(decoded.chunks) == len(tokens) // CHUNK
    return store_s, fetch_s


def lookup_vs_fetch(r3: R3Client, tokens, repeats: int) -> tuple[float, float]:
    lookups, fetches = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        r3.lookup(tokens).result()
        lookups.append(time.perf_counter() - started)
        started = time.perf_counter()
        r3.fetch(tokens).result()
        fetches.append(time.perf_counter() - started)
    return statistics.median(lookups), statistics.median(fetches)


def stored_chunks(r3: R3Client, profile: R3Profile, requests: int, seed: int) -> list[list[int]]:
    """The prompts of ``requests`` requests of one chunk each, their R3 stored."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 50000, size=CHUNK).tolist() for _ in range(requests)]
    for tokens in prompts:
        rows = rng.integers(0, profile.num_experts, size=(CHUNK, *profile.row_shape)).astype(profile.dtype)
        r3.store(tokens, 0, encode_run(profile, 0, rows, CHUNK)).result()
    return prompts


def fetch_many_vs_fetches(r3: R3Client, profile: R3Profile, requests: int, repeats: int) -> tuple[float, float]:
    """One engine step's R3 fetch for ``requests`` requests of one stored chunk each, as the connector sends it (one
    ``fetch_many`` call), against one ``fetch`` call per request; medians of ``repeats``."""
    prompts = stored_chunks(r3, profile, requests, seed=requests)
    items = [(tokens, 0, CHUNK, "") for tokens in prompts]
    many, single = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        results = r3.fetch_many(items).result().results
        many.append(time.perf_counter() - started)
        assert all(result.num_hit_chunks == 1 for result in results), "a stored chunk was not fetched"
        started = time.perf_counter()
        for tokens in prompts:
            r3.fetch(tokens).result()
        single.append(time.perf_counter() - started)
    return statistics.median(many), statistics.median(single)


def hot_fetch_many(server, r3: R3Client, profile: R3Profile, requests: int, repeats: int) -> tuple[float, float]:
    """One ``fetch_many`` of ``requests`` requests of one chunk each, all in L1: median round trip and the server's
    R3 handler time per call (``read_handler_us`` in ``/status``)."""
    items = [(tokens, 0, CHUNK, "") for tokens in stored_chunks(r3, profile, requests, seed=1000 + requests)]
    r3.fetch_many(items).result()  # warm-up
    handler_us = server.status()["lmcache_r3"]["read_handler_us"]
    trips = []
    for _ in range(repeats):
        started = time.perf_counter()
        results = r3.fetch_many(items).result().results
        trips.append(time.perf_counter() - started)
        assert all(result.num_hit_chunks == 1 for result in results), "a stored chunk was not fetched"
    handler_us = server.status()["lmcache_r3"]["read_handler_us"] - handler_us
    return statistics.median(trips), handler_us * 1e-6 / repeats


def with_shm_tier(settings, logs: Path, profile: R3Profile, requests: int, repeats: int) -> tuple[float, float]:
    """:func:`hot_fetch_many` on a second server, the same but with an shm tier below L1."""
    root = tempfile.mkdtemp(prefix="lmcache_r3-bench-shm-", dir="/dev/shm")  # mode 0700, ours
    tier = l2_adapter_spec({"type": "shm", "root": root, "capacity_bytes": 1 << 30})
    tiered = dataclasses.replace(settings, port=free_port(), http_port=free_port(), l2_adapters=(tier,))
    server = start_server(tiered, logs / "server-shm.log")
    try:
        with R3Client(server.url, MODEL, profile, timeout_s=120) as r3:
            return hot_fetch_many(server, r3, profile, requests, repeats)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--kv-layers", type=int, default=48)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of docs/benchmarks.md")
    args = parser.parse_args()
    exit_on_sigterm()
    os.environ.update(TELEMETRY_OFF)
    profile = R3Profile(num_layers=48, top_k=8, num_experts=128)
    kv_per_token = args.kv_layers * 2 * args.kv_heads * args.head_dim * 2
    l1_gb = (args.tokens * (kv_per_token + profile.bytes_per_token) * 1.6) / 2**30 + 0.5

    logs = Path(tempfile.mkdtemp(prefix="lmcache_r3-bench-"))
    server = start_loopback_server(
        logs, chunk_size=CHUNK, l1_size_gb=round(l1_gb, 1), server_modules=(r3_server_module_spec("##r3"),)
    )
    settings = server.settings
    try:
        scheduler, worker, blocks, kv_nbytes = kv_setup(
            server.url, args.tokens, args.kv_layers, args.kv_heads, args.head_dim
        )
        rng = np.random.default_rng(0)
        rows_nbytes = args.tokens * profile.bytes_per_token
        prompts = [
            (rng.integers(10, 50000, size=args.tokens).tolist(), rng.integers(0, 128, size=(args.tokens, 48, 8)))
            for _ in range(args.repeats)
        ]
        kv_samples, r3_samples = [], []
        with R3Client(server.url, MODEL, profile, timeout_s=120) as r3:
            # Each kind runs on an otherwise idle server, so neither pays for the other's background work.
            for repeat, (tokens, _) in enumerate(prompts):
                kv_samples.append(kv_round(scheduler, worker, blocks, tokens, f"kv{repeat}"))
                clear_when_unlocked(server)
            for tokens, rows in prompts:
                r3_samples.append(r3_round(r3, profile, tokens, rows.astype(np.uint8)))
                clear_when_unlocked(server)
            tokens, rows = prompts[-1][0], prompts[-1][1].astype(np.uint8)
            small = tokens[: 4 * CHUNK]
            r3.store(small, 0, encode_run(profile, 0, rows[: 4 * CHUNK], CHUNK)).result()
            small_lookup, small_fetch = lookup_vs_fetch(r3, small, 50)
            r3.store(tokens, 0, encode_run(profile, 0, rows, CHUNK)).result()
            big_lookup, big_fetch = lookup_vs_fetch(r3, tokens, 10)
            batches = {n: fetch_many_vs_fetches(r3, profile, n, 30) for n in (1, 8, 32)}
            hot = hot_fetch_many(server, r3, profile, HOT_REQUESTS, 200)
        worker.shutdown()
        scheduler.shutdown()
        server.stop()  # the tiered server runs alone
        hot_tiered = with_shm_tier(settings, logs, profile, HOT_REQUESTS, 200)
    except BaseException:
        print(f"bench_r3_server stopped; the servers' logs are in {logs}", file=sys.stderr)
        raise
    finally:
        server.stop()
    shutil.rmtree(logs, ignore_errors=True)

    kv_store, kv_retrieve = (statistics.median(column) for column in zip(*kv_samples, strict=True))
    r3_store, r3_fetch = (statistics.median(column) for column in zip(*r3_samples, strict=True))
    kv_total, r3_total = kv_store + kv_retrieve, r3_store + r3_fetch
    command = "python bench/bench_r3_server.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            SECTION,
            "",
            f"`{command.strip()}` on nproc {os.cpu_count()} ({platform.processor() or platform.machine()}), "
            f"{datetime.date.today()}; lmcache 0.5.6, one `lmcache server` (CPU, lmcache_driven, chunk {CHUNK}) "
            f"started by the benchmark; medians of {args.repeats} prompts, KV rounds first, then R3 rounds, L1 cleared "
            "between rounds.",
            "",
            f"One prompt of {args.tokens} tokens: KV {kv_nbytes / 2**30:.2f} GiB ({args.kv_layers} layers x "
            f"{args.kv_heads} KV heads x {args.head_dim}, bf16), R3 {rows_nbytes / 2**20:.1f} MiB "
            f"({profile.describe()}).",
            "",
            "| operation | stock KV | R3 | R3 / KV |",
            "| --- | --- | --- | --- |",
            f"| store (until visible) | {kv_store * 1e3:.0f} ms | {r3_store * 1e3:.1f} ms | "
            f"{r3_store / kv_store:.2%} |",
            f"| lookup + retrieve / fetch + decode | {kv_retrieve * 1e3:.0f} ms | {r3_fetch * 1e3:.1f} ms | "
            f"{r3_fetch / kv_retrieve:.2%} |",
            f"| **both** | {kv_total * 1e3:.0f} ms | {r3_total * 1e3:.1f} ms | **{r3_total / kv_total:.2%}** |",
            "",
            "Goal: R3 adds at most 3% to the KV time. KV: store, then lookups until the server reports the chunks "
            "(it commits asynchronously), then lookup + retrieve into the KV tensors. R3: one store call (the module "
            "commits before it answers; visibility is asserted right after, untimed), then one fetch call whose "
            "objects are verified by the server and decoded by the client.",
            "",
            "Should the R3 lookup return the objects? Median round trip of a count-only lookup and of a fetch "
            "(count + verified objects) of the same chunks:",
            "",
            "| chunks | lookup | fetch | fetch / lookup |",
            "| --- | --- | --- | --- |",
            f"| 4 | {small_lookup * 1e3:.2f} ms | {small_fetch * 1e3:.2f} ms | {small_fetch / small_lookup:.2f}x |",
            f"| {args.tokens // CHUNK} | {big_lookup * 1e3:.1f} ms | {big_fetch * 1e3:.1f} ms | "
            f"{big_fetch / big_lookup:.2f}x |",
            "",
            "One engine step's R3 fetch for a batch of requests (one stored chunk each): the connector's one "
            "`fetch_many` call, which the server reads with one prefetch of every range's keys, against one `fetch` "
            "call per request:",
            "",
            "| requests | one `fetch_many` | one `fetch` each | fetch_many / fetches |",
            "| --- | --- | --- | --- |",
            *(
                f"| {n} | {many * 1e3:.2f} ms | {single * 1e3:.2f} ms | {many / single:.2f}x |"
                for n, (many, single) in batches.items()
            ),
            "",
            f"The same `fetch_many` of {HOT_REQUESTS} requests, all in L1, on this server and on a second one started "
            "the same but with an shm tier below L1 (medians of 200 calls; handler: the R3 module's server time per "
            "call, `read_handler_us` in `/status`). With tiers, the module asks L1 first on its own thread and goes "
            "through LMCache's prefetch thread (L1 and the tiers) only when L1 lacks a chunk:",
            "",
            "| server | round trip | handler |",
            "| --- | --- | --- |",
            f"| no L2 tier | {hot[0] * 1e3:.2f} ms | {hot[1] * 1e3:.2f} ms |",
            f"| shm tier below L1 | {hot_tiered[0] * 1e3:.2f} ms | {hot_tiered[1] * 1e3:.2f} ms |",
            "",
        ]
    )
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
