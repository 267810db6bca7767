"""Routed experts in a vLLM output: how they are encoded, and how a trainer reads them back.

Each finished request carries ``kv_transfer_params["routed_experts"]``: base64 of the ``np.save`` bytes of
``[num_tokens - 1, num_layers, top_k]`` (uint8 for at most 256 experts, else uint16), the encoding vLLM's own
OpenAI server uses for its field, so it survives JSON. Row ``i`` is the routing of token ``i`` (prompt tokens
first, then output tokens); the last sampled token never ran, so it has no row.

    from lmcache_r3 import routed_experts
    outputs = llm.generate(prompts, SamplingParams(max_tokens=64, stop_token_ids=[eos]))
    rows = routed_experts(outputs[0])          # np.ndarray [prompt + output - 1, layers, top_k]

Each encoded array travels with the fingerprint of the tokens it belongs to (:func:`token_fingerprint`), and both
readers check it, so rows are never handed out for another token sequence: vLLM's OpenAI server returns one
``kv_transfer_params`` per response, that of one of its prompts, and a response to several prompts carries the rows
of one of them only (:func:`routed_experts_from_params` then refuses the others).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pybase64
import xxhash

ROUTED_EXPERTS_KEY = "routed_experts"
ROUTED_EXPERTS_ERROR_KEY = "routed_experts_error"
SOURCES_KEY = "lmcache_r3_sources"
"""Where the request's rows came from: ``{"vllm_cached_tokens", "lmcache_tokens", "computed_tokens"}``, summing
to ``num_tokens - 1``; each token's KV and routing came from the same source (computed includes output tokens)."""
SIBLINGS_KEY = "routed_experts_by_index"
"""Parallel sampling (n > 1): ``{completion index (str): encoded rows}`` of every completion of the request."""
FINGERPRINT_KEY = "routed_experts_fingerprint"
"""The :func:`token_fingerprint` of the tokens whose routing ``routed_experts`` holds (prompt + outputs)."""
SIBLING_FINGERPRINTS_KEY = "routed_experts_fingerprint_by_index"
"""Parallel sampling: ``{completion index (str): token fingerprint}`` beside :data:`SIBLINGS_KEY`."""
SIBLING_ERRORS_KEY = "routed_experts_error_by_index"
"""Parallel sampling: ``{completion index (str): why its rows are incomplete}`` for the completions that have none."""


class RoutedExpertsUnavailable(LookupError):
    """The output carries no routed experts; the message says why and what to do instead."""


def encode_routed_experts(rows: np.ndarray) -> str:
    """``rows`` as base64 of ``np.save`` bytes (JSON-safe, and what vLLM's OpenAI server returns).

    The engine encodes every finished request's rows on its scheduling thread, so this is the byte-identical
    result of ``base64.b64encode`` of ``np.save`` done with one copy of the rows (the ``np.save`` header, then
    the rows) and SIMD base64 (pybase64): about a tenth of the time of ``np.save`` into a ``BytesIO`` and the
    standard library's base64 (docs/benchmarks.md, "Routed experts in the output").
    """
    rows = np.ascontiguousarray(rows)
    if rows.dtype.hasobject:
        raise ValueError(f"routed experts must be integer rows, got {rows.dtype}")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(rows))
    return pybase64.b64encode_as_string(b"".join((header.getvalue(), rows)))


def decode_routed_experts(encoded: str | bytes) -> np.ndarray:
    """The array :func:`encode_routed_experts` encoded (``allow_pickle`` stays off).

    Raises:
        RoutedExpertsUnavailable: ``encoded`` is not strict base64 of an ``np.save`` of ``[n, num_layers, top_k]``
            uint8 / uint16 rows (damaged in transit, or not routed experts at all).
    """
    try:
        rows = np.load(io.BytesIO(pybase64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (ValueError, TypeError, EOFError, OSError) as err:  # binascii.Error is a ValueError
        raise RoutedExpertsUnavailable(f"the routed experts do not decode ({err}): the response was damaged") from err
    if not isinstance(rows, np.ndarray) or rows.ndim != 3 or rows.dtype not in (np.uint8, np.uint16):
        raise RoutedExpertsUnavailable(
            "the routed experts are not [num_tokens - 1, num_layers, top_k] uint8 / uint16 rows (got "
            f"{getattr(rows, 'dtype', type(rows).__name__)} {getattr(rows, 'shape', '')}): the response was damaged"
        )
    return rows


def token_fingerprint(token_ids: Sequence[int]) -> str:
    """``"<number of tokens>:<XXH3-64 of the ids as little-endian int64, 16 hex digits>"``: names the token sequence
    (prompt + outputs) that a request's routed experts belong to."""
    ids = np.fromiter(token_ids, dtype="<i8", count=len(token_ids))  # a list's ints without an object array
    return f"{ids.shape[0]}:{xxhash.xxh3_64_hexdigest(ids)}"


def routed_experts(request_output: Any, index: int | None = None) -> np.ndarray:
    """The routed experts of one completion of a finished vLLM ``RequestOutput``.

    Args:
        request_output: a finished ``RequestOutput`` of a vLLM run with lmcache_r3's connector.
        index: the completion (``CompletionOutput.index``) when the request sampled several (n > 1); the first
            completion's when None.

    Returns:
        ``[num_tokens - 1, num_layers, top_k]`` uint8 / uint16, num_tokens = prompt + that completion's outputs.

    Raises:
        RoutedExpertsUnavailable: no routing is in the output: the request is not finished, was aborted (a stop
            *string* makes vLLM's front end abort it), or its rows were incomplete; the message says which.
    """
    completions = list(getattr(request_output, "outputs", None) or ())
    if not completions:
        raise RoutedExpertsUnavailable(
            f"{type(request_output).__name__} has no completions: pass the RequestOutput of a generate call"
        )
    completion = completions[0] if index is None else next((c for c in completions if c.index == index), None)
    if completion is None:
        raise RoutedExpertsUnavailable(f"the request has no completion with index {index}")
    params = getattr(request_output, "kv_transfer_params", None) or {}
    if not getattr(request_output, "finished", False):
        raise RoutedExpertsUnavailable("routed experts are returned with the final output of a request only")
    tokens = [*(getattr(request_output, "prompt_token_ids", None) or ()), *completion.token_ids]
    siblings = params.get(SIBLINGS_KEY)
    if siblings is not None and str(completion.index) in siblings:  # n > 1: whatever became of the last completion
        return _checked(params, tokens, str(completion.index))
    _raise_recorded_error(params, None if siblings is None else str(completion.index))
    if ROUTED_EXPERTS_KEY in params and (len(completions) == 1 or siblings is None):
        return _checked(params, tokens, None)
    if isinstance(getattr(completion, "stop_reason", None), str):
        raise RoutedExpertsUnavailable(
            f"the request ended on the stop string {completion.stop_reason!r}: vLLM's front end aborts such "
            "requests after the engine ran them, so the engine returns no kv_transfer_params and no routing. "
            "Stop on token ids instead (SamplingParams(stop_token_ids=[...]) or EOS), which end the request "
            "inside the engine, and trim the text yourself."
        )
    raise RoutedExpertsUnavailable(
        "the output carries no routed experts: serve the model with kv_connector LMCacheMPConnector from "
        "lmcache_r3.mp.connector (routed experts on, a MoE model), and read the final output of the request"
    )


def _raise_recorded_error(params: dict[str, Any], key: str | None) -> None:
    """Raise the reason the engine recorded for the rows asked for (one completion's, with n > 1), if any."""
    if key is None:
        error = params.get(ROUTED_EXPERTS_ERROR_KEY)
    else:
        error = params.get(SIBLING_ERRORS_KEY, {}).get(key)
    if error:
        raise RoutedExpertsUnavailable(error)


def routed_experts_from_params(
    kv_transfer_params: dict[str, Any] | None, token_ids: Sequence[int], index: int | None = None
) -> np.ndarray:
    """The routed experts of a response of vLLM's OpenAI server (its ``kv_transfer_params``), checked against the
    tokens they must belong to.

    Args:
        kv_transfer_params: the response's ``kv_transfer_params``.
        token_ids: the prompt's token ids followed by the choice's output token ids (ask the server for them with
            ``"return_token_ids": true``).
        index: the choice's ``index`` when the request sampled several (``n`` > 1).

    Returns:
        ``[len(token_ids) - 1, num_layers, top_k]`` uint8 / uint16.

    Raises:
        RoutedExpertsUnavailable: the response carries no routed experts (the message says why), or they belong to
            other tokens: a response to several prompts carries the rows of one of them only.
    """
    params = kv_transfer_params or {}
    siblings = params.get(SIBLINGS_KEY)
    key = None if index is None or siblings is None else str(index)
    if key is None or key not in siblings:
        _raise_recorded_error(params, key)
    if key is not None and key not in siblings:
        raise RoutedExpertsUnavailable(f"the response has no routed experts for choice {index}")
    if key is None and ROUTED_EXPERTS_KEY not in params:
        raise RoutedExpertsUnavailable(
            "the response carries no routed experts: the server must run lmcache_r3's connector with routed experts "
            "on, and a request that ends on a stop string is aborted by vLLM's front end and returns none (stop on "
            "token ids instead)"
        )
    return _checked(params, list(token_ids), key)


def _checked(params: dict[str, Any], token_ids: list[int], index: str | None) -> np.ndarray:
    """The encoded rows of ``params`` (of choice ``index``, or the request's), after checking that their token
    fingerprint is that of ``token_ids``."""
    if index is None:
        encoded, fingerprint = params[ROUTED_EXPERTS_KEY], params.get(FINGERPRINT_KEY)
    else:
        encoded, fingerprint = params[SIBLINGS_KEY][index], params.get(SIBLING_FINGERPRINTS_KEY, {}).get(index)
    expected = token_fingerprint(token_ids)
    if fingerprint != expected:
        raise RoutedExpertsUnavailable(
            f"these routed experts belong to another token sequence (fingerprint {fingerprint}, the tokens given: "
            f"{expected}). vLLM's OpenAI server returns one kv_transfer_params per response, that of one of its "
            "prompts: send one prompt per request (n > 1 is fine), and pass the prompt's token ids followed by the "
            "choice's output token ids"
        )
    rows = decode_routed_experts(encoded)
    if rows.shape[0] != len(token_ids) - 1:
        raise RoutedExpertsUnavailable(
            f"the routed experts hold {rows.shape[0]} rows for {len(token_ids)} tokens (one row per token but the "
            "last is expected): the response was damaged"
        )
    return rows
