"""Benchmark of the R3 artifact core against memcpy of the same bytes, measured in the same run.

    python bench/bench_artifacts.py            # print the figures
    python bench/bench_artifacts.py --write    # and replace the "## R3 artifact core" section of docs/benchmarks.md
    python bench/bench_artifacts.py --gpu-check   # CUDA kernel vs the numpy reference, and its throughput
    python bench/bench_artifacts.py --checksums   # the checksum candidates importable here, against memcpy
    python bench/bench_artifacts.py --output --write   # routed experts into a vLLM output and back, against
                                                       # np.save + stdlib base64 ("## Routed experts in the output")

Every figure is the median of repeated runs, reported as a ratio to a memcpy of the same bytes timed the same way:
for throughput, ``memcpy time / operation time`` (1.0 = as fast as memcpy); for materialize, ``operation time /
memcpy time`` (1.0 = as fast as one memcpy).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import gc
import io
import mmap
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import pybase64
import xxhash
from benchdocs import DOCS, write_section

from lmcache_r3.artifacts import (
    GatherNarrowError,
    R3Profile,
    SlotMirror,
    cuda_available,
    decode_chunk,
    decode_run,
    encode_chunk,
    encode_header,
    encode_run,
    gather_narrow_reference,
)
from lmcache_r3.output import decode_routed_experts, encode_routed_experts, token_fingerprint

SECTION = "## R3 artifact core"
OUTPUT_SECTION = "## Routed experts in the output"
PROFILE = R3Profile(48, 8, 128)  # 384 B per token, uint8
CHUNK_TOKENS = 256
REQUEST_TOKENS = 32768


def median_seconds(operation: Callable[[], object], inner: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` back-to-back calls."""
    operation()
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                operation()
            samples.append((time.perf_counter() - start) / inner)
    finally:
        gc.enable()
    return statistics.median(samples)


def fastest_memcpy(src: np.ndarray, inner: int, repeats: int) -> float:
    """The faster of copying ``src`` into a new buffer and into a preallocated one (the stricter baseline)."""
    dst = np.empty_like(src)
    return min(
        median_seconds(src.tobytes, inner, repeats),
        median_seconds(lambda: np.copyto(dst, src), inner, repeats),
    )


def codec_rows(quick: bool) -> list[str]:
    """Encode + decode against memcpy: one cache-hot chunk, a hit of a few chunks and a whole request as one run,
    one large chunk."""
    rng = np.random.default_rng(0)
    repeats = 5 if quick else 15
    request = rng.integers(0, PROFILE.num_experts, (REQUEST_TOKENS, *PROFILE.row_shape)).astype(PROFILE.dtype)
    hot = request[:CHUNK_TOKENS]
    hot_object = encode_chunk(PROFILE, 0, hot)
    run = encode_run(PROFILE, 0, request, CHUNK_TOKENS)
    few = request[: 4 * CHUNK_TOKENS]
    few_run = encode_run(PROFILE, 0, few, CHUNK_TOKENS)
    few_starts = range(0, few.shape[0], CHUNK_TOKENS)
    big = request[:4096]
    big_object = encode_chunk(PROFILE, 0, big)
    assert len(decode_run(run, PROFILE, 0, CHUNK_TOKENS).chunks) == REQUEST_TOKENS // CHUNK_TOKENS

    def headers_of_run() -> None:
        for start in range(0, REQUEST_TOKENS, CHUNK_TOKENS):
            encode_header(PROFILE, start, request[start : start + CHUNK_TOKENS])

    cases = [
        (
            f"one {CHUNK_TOKENS}-token chunk ({hot.nbytes >> 10} KiB), cache-hot: `encode_chunk` + `decode_chunk`",
            hot, 2000,
            lambda: encode_chunk(PROFILE, 0, hot),
            lambda: decode_chunk(hot_object, PROFILE),
            lambda: encode_header(PROFILE, 0, hot),
        ),
        (
            f"a hit of 4 chunks ({few.nbytes >> 10} KiB) as one run: `encode_run` + `decode_run`",
            few, 500,
            lambda: encode_run(PROFILE, 0, few, CHUNK_TOKENS),
            lambda: decode_run(few_run, PROFILE, 0, CHUNK_TOKENS),
            lambda: [encode_header(PROFILE, start, few[start : start + CHUNK_TOKENS]) for start in few_starts],
        ),
        (
            f"{REQUEST_TOKENS // 1024}k-token request ({request.nbytes >> 20} MiB) as one run of "
            f"{REQUEST_TOKENS // CHUNK_TOKENS} chunks: `encode_run` + `decode_run`",
            request, 10,
            lambda: encode_run(PROFILE, 0, request, CHUNK_TOKENS),
            lambda: decode_run(run, PROFILE, 0, CHUNK_TOKENS),
            headers_of_run,
        ),
        (
            f"one 4096-token chunk ({big.nbytes / 2**20:.1f} MiB): `encode_chunk` + `decode_chunk`",
            big, 100,
            lambda: encode_chunk(PROFILE, 0, big),
            lambda: decode_chunk(big_object, PROFILE),
            lambda: encode_header(PROFILE, 0, big),
        ),
    ]  # fmt: skip
    lines = []
    for label, src, inner, encode, decode, header_only in cases:
        memcpy = fastest_memcpy(src, inner, repeats)
        encoded = median_seconds(encode, inner, repeats)
        decoded = median_seconds(decode, inner, repeats)
        header = median_seconds(header_only, inner, repeats)
        gbps = src.nbytes / 1e9
        lines.append(
            f"| {label} | {gbps / memcpy:.1f} GB/s | {gbps / (encoded + decoded):.1f} GB/s | "
            f"**{memcpy / (encoded + decoded):.2f}x** | {memcpy / (header + decoded):.2f}x |"
        )
    hash_ratio = fastest_memcpy(hot, 2000, repeats) / median_seconds(
        lambda: xxhash.xxh3_64_intdigest(hot), 2000, repeats
    )
    lines.append(f"| XXH3-64 of one {hot.nbytes >> 10} KiB chunk (for reference) | | | {hash_ratio:.2f}x | |")
    return lines


def fresh_memcpy_seconds(src: np.ndarray, repeats: int) -> float:
    """Copy into memory just mapped from the OS, so every page faults once (what a new allocation may cost)."""

    def copy() -> None:
        with mmap.mmap(-1, src.nbytes) as region:
            dst = np.frombuffer(region, dtype=src.dtype).reshape(src.shape)
            np.copyto(dst, src)
            del dst

    return median_seconds(copy, 3, repeats)


def materialize_rows(quick: bool) -> list[str]:
    """A finished 32k-token request's rows, read from the slot mirror through its block table, against one memcpy.

    The request holds 2048 blocks of 16 scattered over a pool of 8192 (as a running engine leaves them); its rows
    were written there step by step (computed) or from decoded chunks (an LMCache hit).
    """
    rng = np.random.default_rng(1)
    repeats = 5 if quick else 11
    block = 16
    rows = rng.integers(0, PROFILE.num_experts, (REQUEST_TOKENS, *PROFILE.row_shape)).astype(PROFILE.dtype)
    run = encode_run(PROFILE, 0, rows, CHUNK_TOKENS)
    blocks = rng.permutation(4 * REQUEST_TOKENS // block)[: REQUEST_TOKENS // block]
    mirror = SlotMirror(PROFILE, num_blocks=4 * REQUEST_TOKENS // block, block_size=block)
    slots = mirror.slots_for(blocks, 0, REQUEST_TOKENS)
    mirror.write(slots, rows)
    assert np.array_equal(mirror.read(blocks, 0, REQUEST_TOKENS), rows)

    def hit_then_read() -> np.ndarray:
        """An LMCache hit: decode the run (checksums verified), write it at the slots, read the request back."""
        decoded = decode_run(run, PROFILE, 0, CHUNK_TOKENS).chunks
        mirror.write(slots, np.concatenate([chunk.rows for chunk in decoded]))
        return mirror.read(blocks, 0, REQUEST_TOKENS)

    decode_steps = [(slots[i : i + 4], rows[i : i + 4]) for i in range(0, 4096, 4)]

    def decode_steps_then_read() -> np.ndarray:
        """1024 decode steps of 4 requests queued (one per step), then applied and read by one read."""
        for step_slots, step_rows in decode_steps:
            mirror.queue(step_slots, step_rows)
        return mirror.read(blocks, 0, REQUEST_TOKENS)

    warm = np.empty_like(rows)
    memcpy = median_seconds(lambda: np.copyto(warm, rows), 3, repeats)
    cases = [
        ("one memcpy of the result into fresh memory (page faults included)", fresh_memcpy_seconds(rows, repeats)),
        ("read the request's rows from the mirror (2048 scattered blocks)",
         median_seconds(lambda: mirror.read(blocks, 0, REQUEST_TOKENS), 3, repeats)),
        ("LMCache hit: `decode_run` (checksums verified) + write at the slots + read",
         median_seconds(hit_then_read, 3, repeats)),
        ("1024 four-request decode steps queued, then applied + read",
         median_seconds(decode_steps_then_read, 3, repeats)),
    ]  # fmt: skip
    lines = [
        f"| one memcpy of the result ({rows.nbytes >> 20} MiB) into a warm array | {memcpy * 1e3:.2f} ms | 1.00x |"
    ]
    lines += [f"| {label} | {seconds * 1e3:.2f} ms | **{seconds / memcpy:.2f}x** |" for label, seconds in cases]
    return lines


def stdlib_encode(rows: np.ndarray) -> str:
    """The baseline: ``np.save`` into a ``BytesIO``, then the standard library's base64."""
    buffer = io.BytesIO()
    np.save(buffer, rows, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def stdlib_decode(encoded: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)


def output_rows(quick: bool) -> list[str]:
    """A finished request's rows into its output (the engine, once per request, on its scheduling thread) and back
    (the trainer), against ``np.save`` + stdlib base64 of the same rows, at three request lengths."""
    rng = np.random.default_rng(1)
    repeats = 5 if quick else 11
    return [output_row(rng, num_tokens, inner, repeats) for num_tokens, inner in ((256, 200), (4096, 20), (32768, 3))]


def output_row(rng: np.random.Generator, num_tokens: int, inner: int, repeats: int) -> str:
    rows = rng.integers(0, PROFILE.num_experts, (num_tokens - 1, *PROFILE.row_shape)).astype(PROFILE.dtype)
    encoded = encode_routed_experts(rows)
    assert encoded == stdlib_encode(rows)  # the same bytes, or the comparison means nothing
    tokens = [int(t) for t in rng.integers(0, 150_000, num_tokens)]
    std_enc, enc, std_dec, dec, fingerprint = (
        median_seconds(operation, inner, repeats) * 1e3
        for operation in (
            lambda: stdlib_encode(rows),
            lambda: encode_routed_experts(rows),
            lambda: stdlib_decode(encoded),
            lambda: decode_routed_experts(encoded),
            lambda: token_fingerprint(tokens),
        )
    )
    return (
        f"| {num_tokens} tokens ({rows.nbytes / 2**20:.2f} MiB) | {std_enc:.3f} ms | {enc:.3f} ms | "
        f"**{std_enc / enc:.1f}x** | {std_dec:.3f} ms | {dec:.3f} ms | **{std_dec / dec:.1f}x** | "
        f"{fingerprint:.3f} ms |"
    )


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor() or "unknown CPU",
    )
    return (
        f"nproc {os.cpu_count()} ({model}), Python {platform.python_version()}, numpy {np.__version__}, "
        f"xxhash {xxhash.VERSION}"
    )


def invocation() -> str:
    """The command line that produced a report, as docs/benchmarks.md quotes it."""
    return " ".join(["python bench/bench_artifacts.py", *sys.argv[1:]])


def report(quick: bool) -> str:
    out = [
        SECTION,
        "",
        f"`{invocation()}` on {machine()}, {datetime.date.today().isoformat()}.",
        f"Profile {PROFILE.describe()}; {CHUNK_TOKENS}-token chunks. Each figure is a median of repeated runs;",
        "each ratio is against a memcpy of the same bytes timed in the same run.",
        "",
        "Encode + decode, goal at least 0.5x memcpy. memcpy is the faster of copying into a new buffer and into",
        "a preallocated one. *header-only* replaces the encode by `encode_header` (checksum + header, no payload",
        "copy), i.e. the codec's own cost when the writer's copy into its message or tier buffer is the only one.",
        "",
        "| case | memcpy | encode + decode | ratio | header-only encode + decode |",
        "| --- | --- | --- | --- | --- |",
        *codec_rows(quick),
        "",
        f"Materialize a finished {REQUEST_TOKENS // 1024}k-token request's R3 from the slot mirror, goal within 3x of "
        "one memcpy of the result.",
        "",
        "| case | time | vs memcpy |",
        "| --- | --- | --- |",
        *materialize_rows(quick),
    ]
    return "\n".join(out) + "\n"


def output_report(quick: bool) -> str:
    out = [
        OUTPUT_SECTION,
        "",
        f"`{invocation()}` on {machine()}, pybase64 {pybase64.get_version()}, {datetime.date.today().isoformat()}.",
        f"Profile {PROFILE.describe()}. Each figure is a median of repeated runs.",
        "",
        'A finished request\'s rows into its output, `kv_transfer_params["routed_experts"]` (base64 of `np.save`',
        "bytes), which the engine does once per finished request on its scheduling thread, and back (the trainer's",
        "`lmcache_r3.routed_experts`), against `np.save` into a `BytesIO` + the standard library's base64 of the same",
        "rows in the same run (the encodings are asserted byte-equal); *fingerprint*: the XXH3-64 of the request's",
        "token ids that travels with the rows.",
        "",
        "| request | encode: np.save + base64 | encode: ours | speed-up | decode: base64 + np.load | decode: ours "
        "| speed-up | fingerprint |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *output_rows(quick),
    ]
    return "\n".join(out) + "\n"


def checksum_report() -> str:
    """Throughput of the checksum candidates that are importable here, on one 96 KiB chunk, against memcpy."""
    import hashlib
    import zlib

    chunk = np.random.default_rng(3).integers(0, 256, CHUNK_TOKENS * PROFILE.bytes_per_token, dtype=np.uint8)
    data = chunk.tobytes()
    candidates: list[tuple[str, Callable[[], object]]] = [
        ("xxhash XXH3-64", lambda: xxhash.xxh3_64_intdigest(data)),
        ("xxhash XXH64", lambda: xxhash.xxh64_intdigest(data)),
        ("zlib CRC-32 (stdlib)", lambda: zlib.crc32(data)),
        ("hashlib BLAKE2b-64 (stdlib)", lambda: hashlib.blake2b(data, digest_size=8).digest()),
        ("hashlib SHA-256 (stdlib)", lambda: hashlib.sha256(data).digest()),
    ]
    optional = {"google_crc32c": ("google-crc32c CRC-32C", "value"), "blake3": ("blake3 BLAKE3", "blake3")}
    for module_name, (label, attribute) in optional.items():
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        function = getattr(module, attribute)
        candidates.append((label, lambda f=function: f(data)))
    memcpy = fastest_memcpy(chunk, 2000, 9)
    lines = [f"memcpy of {len(data) >> 10} KiB: {len(data) / memcpy / 1e9:.1f} GB/s", ""]
    for label, function in candidates:
        seconds = median_seconds(function, 200, 9)
        lines.append(f"{label:30s} {len(data) / seconds / 1e9:7.1f} GB/s  {memcpy / seconds:5.2f}x memcpy")
    return "\n".join(lines)


def gpu_check() -> int:
    if not cuda_available():
        print(
            "gpu-check: no CUDA device is visible to CuPy (no GPU, no driver, or CuPy missing); "
            "run this on a machine with an NVIDIA GPU and cupy-cuda13x installed.",
            file=sys.stderr,
        )
        return 2
    import cupy

    from lmcache_r3.artifacts.gather import CudaGatherNarrow

    kernel = CudaGatherNarrow()
    rng = np.random.default_rng(2)
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for profile in (PROFILE, R3Profile(48, 8, 384), R3Profile(61, 8, 256), R3Profile(5, 3, 60)):
        captured = rng.integers(0, profile.num_experts, (8192, *profile.row_shape), dtype=np.int32)
        order = rng.permutation(8192)[:6000]
        got = cupy.asnumpy(kernel(cupy.asarray(captured), cupy.asarray(order), profile))
        expected = gather_narrow_reference(captured, order, profile)
        status = "OK" if np.array_equal(got, expected) else "MISMATCH"
        print(f"{status:8s} {profile.describe()}")
        if status != "OK":
            return 1
    bad = rng.integers(0, 60, (16, 5, 3), dtype=np.int32)
    bad[7, 2, 1] = 60
    try:
        kernel(cupy.asarray(bad), cupy.arange(16), R3Profile(5, 3, 60))
        print("MISMATCH an expert id outside the profile was not refused")
        return 1
    except GatherNarrowError:
        print("OK       an expert id outside the profile is refused")
    for num_rows in (8192, 65536):
        captured = cupy.asarray(rng.integers(0, 128, (num_rows, *PROFILE.row_shape), dtype=np.int32))
        order = cupy.asarray(rng.permutation(num_rows))
        gather = _device_seconds(lambda c=captured, o=order: kernel(c, o, PROFILE, check=False))
        copy = _device_seconds(captured.copy)
        moved = captured.nbytes + captured.nbytes // 4  # int32 read + uint8 written
        peer = _device_seconds(lambda c=captured, o=order: c[o].astype(cupy.uint8))
        print(
            f"{num_rows} rows x {PROFILE.num_layers}x{PROFILE.top_k}: gather+narrow {gather * 1e6:.1f} us "
            f"({moved / gather / 1e9:.0f} GB/s moved), device copy of the int32 input {copy * 1e6:.1f} us "
            f"({2 * captured.nbytes / copy / 1e9:.0f} GB/s moved; kernel/copy {gather / copy:.2f}x), "
            f"CuPy fancy-index + astype {peer * 1e6:.1f} us (kernel {peer / gather:.2f}x faster)"
        )
    return _gpu_check_torch(kernel, rng) or _gpu_check_worker_step(rng)


def _gpu_check_worker_step(rng: np.random.Generator) -> int:
    """One worker step of 8192 tokens (16 of them padding, as under CUDA graphs): real rows gathered and narrowed on
    the device, against copying the whole int32 capture buffer to the host and narrowing with numpy (the path
    without the kernel)."""
    import cupy

    from lmcache_r3.mp.step_rows import narrow_step

    mapping = rng.permutation(8 * 8192)[:8192].astype(np.int64)
    mapping[-16:] = -1
    host = rng.integers(0, PROFILE.num_experts, (8192, *PROFILE.row_shape), dtype=np.int32)
    device = cupy.asarray(host)
    device_slots, on_device = narrow_step(mapping, device, PROFILE)
    host_slots, on_host = narrow_step(mapping, host, PROFILE)
    same = np.array_equal(on_device, on_host) and np.array_equal(device_slots, host_slots)
    print(f"{'OK' if same else 'MISMATCH':8s} worker step on the device equals the host path (8176 real tokens)")
    if not same:
        return 1

    def device_step() -> None:
        narrow_step(mapping, device, PROFILE)

    def host_step() -> None:
        narrow_step(mapping, cupy.asnumpy(device), PROFILE)

    device_s, host_s = (median_seconds(f, 20, 7) for f in (device_step, host_step))
    print(f"worker step, 8192 tokens x {PROFILE.num_layers}x{PROFILE.top_k}: kernel path {device_s * 1e3:.2f} ms, "
          f"copy buffer to host + numpy {host_s * 1e3:.2f} ms ({host_s / device_s:.2f}x)")  # fmt: skip
    return 0


def _gpu_check_torch(kernel: object, rng: np.random.Generator) -> int:
    """The capture path hands the kernel torch CUDA tensors: check that they are read in place and exactly."""
    try:
        import torch
    except ImportError:
        print("SKIP     torch is not importable here: torch CUDA tensor input not checked")
        return 0
    if not torch.cuda.is_available():
        print("SKIP     torch sees no CUDA device: torch CUDA tensor input not checked")
        return 0
    import cupy

    captured = rng.integers(0, PROFILE.num_experts, (4096, *PROFILE.row_shape), dtype=np.int32)
    order = rng.permutation(4096)[:3000]
    device_captured = torch.from_numpy(captured).cuda()
    device_order = torch.from_numpy(order).cuda()
    got = cupy.asnumpy(kernel(device_captured, device_order, PROFILE))
    status = "OK" if np.array_equal(got, gather_narrow_reference(captured, order, PROFILE)) else "MISMATCH"
    print(f"{status:8s} torch CUDA tensors as input ({PROFILE.describe()})")
    return 0 if status == "OK" else 1


def _device_seconds(operation: Callable[[], object], reps: int = 50) -> float:
    """Mean device time of ``operation`` over ``reps`` launches, timed with CUDA events."""
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    operation()
    start.record()
    for _ in range(reps):
        operation()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / reps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of {DOCS.name}")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, noisier figures)")
    parser.add_argument("--gpu-check", action="store_true", help="check the CUDA kernel against numpy on a GPU")
    parser.add_argument("--checksums", action="store_true", help="compare the checksum candidates importable here")
    parser.add_argument(
        "--output", action="store_true", help=f"the routed experts' output encoding instead ('{OUTPUT_SECTION}')"
    )
    args = parser.parse_args()
    if args.gpu_check:
        return gpu_check()
    if args.checksums:
        print(checksum_report())
        return 0
    section, text = (OUTPUT_SECTION, output_report(args.quick)) if args.output else (SECTION, report(args.quick))
    print(text)
    if args.write:
        write_section(section, text)
        print(f"updated {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
