"""The demo's own checks: a request whose rows or sources do not add up, or a reference run that was not cold,
is a problem that fails the demo (comparing with a warm "reference" would compare the restore path with itself)."""

import numpy as np
import pytest

from lmcache_r3.demo.run import accounting_problems, cold_problems

COLD = {"vllm_cached_tokens": 0, "lmcache_tokens": 0, "computed_tokens": 9}


@pytest.mark.parametrize(
    ("num_tokens", "sources", "rows", "expected"),
    [
        (10, COLD, np.zeros((9, 2, 2), np.uint8), []),
        (10, {"vllm_cached_tokens": 2, "lmcache_tokens": 4, "computed_tokens": 3}, np.zeros((9, 2, 2)), []),
        (10, COLD, np.zeros((8, 2, 2), np.uint8), ["8 rows of routed experts for 10 tokens"]),
        (10, {"computed_tokens": 8}, np.zeros((9, 2, 2), np.uint8), ["its sources count 8 tokens, expected 9"]),
        (10, {}, "no rows: the request was aborted", ["its sources count 0 tokens"]),
    ],
)
def test_rows_and_sources_must_cover_every_token_but_the_last(num_tokens, sources, rows, expected):
    problems = accounting_problems("conv0/turn1", num_tokens, sources, rows)
    assert len(problems) == len(expected)
    for problem, words in zip(problems, expected, strict=True):
        assert problem.startswith("conv0/turn1: ") and words in problem


@pytest.mark.parametrize(
    ("sources", "objects_left", "expected"),
    [
        (COLD, 0, None),
        (COLD, 3, None),  # locked leftovers that served nothing do not make the reference warm
        ({"lmcache_tokens": 64, "computed_tokens": 9}, 0, "served 64 tokens from LMCache and 0 from vLLM's cache;"),
        ({"lmcache_tokens": 64}, 2, "(LMCache held 2 locked objects after its L1 was cleared)"),
        ({"vllm_cached_tokens": 32}, 0, "served 0 tokens from LMCache and 32 from vLLM's cache"),
    ],
)
def test_a_reference_served_from_any_cache_is_a_problem(sources, objects_left, expected):
    problems = cold_problems("conv0/turn1 (cold)", sources, objects_left)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0] and "must compute every token" in problems[0]
