"""The scheduler-side bookkeeping of routed experts, driven step by step against a real LMCache server with the R3
module. vLLM's ``Request`` is stood in for by the few fields the bookkeeping reads (no engine runs here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from lmcache_r3.artifacts import R3Profile, decode_run
from lmcache_r3.mp.r3_client import R3Client
from lmcache_r3.mp.r3_messages import R3WorkerMetadata, RequestStepRows
from lmcache_r3.mp.routed import RoutedExpertsBook

pytestmark = pytest.mark.server

CHUNK = 64
BLOCK = 32
PROFILE = R3Profile(num_layers=2, top_k=2, num_experts=8)


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    max_tokens: int = 8
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self):
        self.num_prompt_tokens = len(self.all_token_ids)


def rows(start: int, end: int) -> np.ndarray:
    return (np.arange(start, end)[:, None, None] % 8 * np.ones((1, 2, 2), dtype=np.int64)).astype(np.uint8)


def step(request_id: str, start: int, end: int) -> R3WorkerMetadata:
    slots = np.arange(start, end) + 10 * BLOCK  # blocks 10.. hold the request
    return R3WorkerMetadata(rows={request_id: RequestStepRows(start, rows(start, end), slots)})


def test_rows_of_rejected_speculative_tokens_are_never_published(r3_server):
    client = R3Client(r3_server.url, "spec-model", PROFILE)
    book = RoutedExpertsBook(PROFILE, CHUNK, BLOCK, num_blocks=64, client=client, fetch_timeout_s=5)
    tokens = list(range(100, 100 + 2 * CHUNK + 10))
    request = Request("spec", tokens)
    book.begin_lookup(request, 0)
    book.end_lookup(request)
    book.on_store("spec", 0, 2 * CHUNK)  # the KV store covers two chunks
    # A step computed positions [0, 100) plus drafts at [100, 130); vLLM accepted up to 110 only.
    request.num_computed_tokens = 110
    book.on_worker_output(step("spec", 0, 130))
    book.settle(10)
    assert book._requests["spec"].rows.present.end == 110  # the rejected drafts' rows are gone
    fetched = client.fetch(tokens).result()
    assert fetched.num_hit_chunks == 1  # chunk [64, 128) is not complete: nothing past 110 was published
    (chunk,) = decode_run(fetched.objects, PROFILE, 0, CHUNK).chunks
    np.testing.assert_array_equal(chunk.rows, rows(0, CHUNK))
    # The next step recomputes from 110 with the accepted tokens; the second chunk is then published.
    request.num_computed_tokens = 130
    book.on_worker_output(step("spec", 110, 130))
    book.settle(10)
    assert client.fetch(tokens).result().num_hit_chunks == 2
    client.close()
