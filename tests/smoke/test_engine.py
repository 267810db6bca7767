"""vLLM (CPU) with the LMCache MP connector: a prompt's prefix is served by LMCache after vLLM's own prefix
cache is reset, and greedy decoding is unchanged. Runs the demo's code path in a child process (the engine
spawns processes of its own and needs a `__main__` guard)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    ("shape", "connector", "baseline"),
    [("small", "lmcache_r3", True), ("wide", "lmcache_r3", False), ("small", "stock", False)],
)
def test_prefix_served_by_lmcache_gives_identical_greedy_tokens(shape, connector, baseline, tmp_path, model_cache_dir):
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache_r3.demo.run",
            "--shape",
            shape,
            "--workdir",
            str(tmp_path),
            "--json",
            str(result_file),
            "--model-cache",
            str(model_cache_dir),
            "--connector",
            connector,
            *(["--compare-without-connector"] if baseline else []),
        ],
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(result_file.read_text())
    assert result["first"]["cached_tokens"] == 0
    # 200-token prompt, 64-token chunks: three full chunks come from LMCache.
    assert result["second"]["cached_tokens"] == 192
    assert result["second"]["output_tokens"] == result["first"]["output_tokens"]
    assert len(result["first"]["output_tokens"]) == 16
    if baseline:
        assert result["baseline_tokens"] == result["first"]["output_tokens"], "the connector changed greedy output"
