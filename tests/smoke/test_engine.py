"""The main job (`make demo`) end to end: `lmcache-r3 server` from a config file, vLLM (CPU) with lmcache_r3's
connector, multi-turn rollouts with vLLM's prefix cache reset between turns. Every request's routed experts and
greedy tokens must equal a cold run, and LMCache must have served part of the prompts. Each cold run follows the
reset of a weight update (``reset_prefix_cache(reset_connector=True)`` in the engine), which must empty LMCache's L1
and its shm tier: the demo fails a cold run that LMCache served anything. Runs the demo in a child
process (the engine spawns processes of its own and needs a `__main__` guard)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(("shape", "baseline", "dtype_rows"), [("small", True, (2, 2)), ("wide", False, (4, 3))])
def test_demo_serves_prefixes_from_lmcache_with_routed_experts_equal_to_a_cold_run(
    shape, baseline, dtype_rows, tmp_path, model_cache_dir
):
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_r3.demo.run", "--shape", shape, "--workdir", str(tmp_path),
         "--json", str(result_file), "--model-cache", str(model_cache_dir),
         *(["--compare-without-connector"] if baseline else [])],
        capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "DEMO OK" in proc.stdout
    result = json.loads(result_file.read_text())
    requests = result["requests"]
    assert len(requests) == 12 and result["ok"]
    assert result["lmcache_tokens"] > 0, "no prefix came back from LMCache"
    tier = result["tier_counters"]
    assert tier["stored_objects"] > 0 and tier["clears"] == 12, tier  # one reset before each cold run
    assert tier["cleared_objects"] > 0, tier
    for request in requests:
        if not request["name"].endswith("/turn1"):  # the previous turn is reused, from LMCache or a sibling's load
            assert request["lmcache_tokens"] + request["vllm_cached_tokens"] >= 128, request
    for request in requests:
        assert request["r3_equals_cold"] and request["tokens_equal_cold"], request
        num_tokens = request["prompt_tokens"] + len(request["output_tokens"])
        assert tuple(request["r3_shape"]) == (num_tokens - 1, *dtype_rows)
        assert request["vllm_cached_tokens"] + request["lmcache_tokens"] + request["computed_tokens"] == num_tokens - 1
    if baseline:
        assert result["baseline_tokens_equal"] is True, "the connector changed greedy output"
