"""How lmcache_r3's connector is configured: ``kv_connector_extra_config`` merged with ``LMCACHE_CONFIG_FILE``, the
routed-experts switch and profile, and the KV group whose slots key the R3 slot mirror."""

from __future__ import annotations

import logging
from typing import Any

from lmcache_r3.artifacts import R3Profile
from lmcache_r3.config import (
    MAX_R3_STORE_BATCH_STEPS,
    is_positive_seconds,
    load_connector_config,
    stock_connector_extra_config,
)
from lmcache_r3.mp.stock_adapter import group_kinds, keeps_blocks_to_the_end

logger = logging.getLogger(__name__)

__all__ = [
    "R3_STORE_BATCH_KEY",
    "R3_TIMEOUT_KEY",
    "ROUTED_EXPERTS_KEY",
    "SEPARATE_GROUPS_KEY",
    "TRANSFER_MODE_KEY",
    "first_server_url",
    "mirrored_group",
    "refuse_lazy_offload",
    "refuse_r3_without_full_attention",
    "routed_experts_refusal",
    "resolve_extra_config",
    "routed_experts_profile",
]

TRANSFER_MODE_KEY = "lmcache.mp.mp_transfer_mode"
SEPARATE_GROUPS_KEY = "lmcache_r3.separate_object_groups"
ROUTED_EXPERTS_KEY = "lmcache_r3.routed_experts"
R3_TIMEOUT_KEY = "lmcache_r3.r3_timeout_s"
R3_STORE_BATCH_KEY = "lmcache_r3.r3_store_batch_steps"
LAZY_OFFLOAD_KEY = "lmcache.mp.lazy_offload"


def _num_kv_groups(kv_cache_config: Any) -> int:
    """vLLM's KV cache groups: one for a dense model, several for a hybrid one."""
    return len(getattr(kv_cache_config, "kv_cache_groups", ()) or ())


def resolve_extra_config(extra_config: dict[str, Any], kv_cache_config: Any) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` LMCache's connector is built with.

    Server address and timeouts come from the lmcache_r3 config file unless set explicitly. A hybrid model
    (several KV groups) needs lmcache_driven transfer: LMCache 0.5.6's engine-driven transfer handles one group.

    Raises:
        ValueError: a hybrid model with ``lmcache.mp.mp_transfer_mode=engine_driven`` (the message names the mode
            that works), an ``lmcache_r3.routed_experts`` that is not a boolean, an ``lmcache_r3.r3_timeout_s`` that
            is not a positive number, or an ``lmcache_r3.r3_store_batch_steps`` that is not an integer in [0, 1024].
    """
    config = load_connector_config(extra_config)
    merged = stock_connector_extra_config(config, extra_config)
    num_groups = _num_kv_groups(kv_cache_config)
    if num_groups > 1:
        mode = merged.get(TRANSFER_MODE_KEY)
        if mode == "engine_driven":
            raise ValueError(
                f"{TRANSFER_MODE_KEY}=engine_driven cannot serve this model: it has {num_groups} KV cache groups "
                "(a hybrid model) and LMCache 0.5.6 engine-driven transfer supports one. Set "
                f'"{TRANSFER_MODE_KEY}": "lmcache_driven" in kv_connector_extra_config (the server must accept it: '
                "transfer_mode auto or lmcache_driven)."
            )
        merged[TRANSFER_MODE_KEY] = "lmcache_driven"
    # Whether the server runs with --separate-object-groups: said explicitly, or read from the same config file.
    merged.setdefault(SEPARATE_GROUPS_KEY, config.server.separate_groups)
    merged.setdefault(ROUTED_EXPERTS_KEY, config.r3.enabled)
    merged.setdefault(R3_TIMEOUT_KEY, config.connector.r3_timeout_s)
    merged.setdefault(R3_STORE_BATCH_KEY, config.connector.r3_store_batch_steps)
    if type(merged[ROUTED_EXPERTS_KEY]) is not bool:
        switch = merged[ROUTED_EXPERTS_KEY]
        raise ValueError(f"{ROUTED_EXPERTS_KEY} must be true or false (a JSON boolean), got {switch!r}")
    timeout_s = merged[R3_TIMEOUT_KEY]
    if not is_positive_seconds(timeout_s):
        raise ValueError(
            f"{R3_TIMEOUT_KEY} must be a number of seconds > 0 (the bound on each R3 call to the LMCache server), "
            f"got {timeout_s!r}"
        )
    tier_bound_s = config.r3_tier_timeout_s
    if merged[ROUTED_EXPERTS_KEY] and config.tiers and timeout_s <= tier_bound_s:
        raise ValueError(
            f"{R3_TIMEOUT_KEY} ({timeout_s}) must be above the server's bound on its tiers for one R3 read, "
            f"{tier_bound_s:g} s (r3.tier_timeout_s, else 0.8 x connector.r3_timeout_s, of the config file the server "
            "runs from): the connector would give up on R3 reads while a server thread, one of those KV lookups "
            "need, still waits for the tiers. Raise it, or lower r3.tier_timeout_s in that file"
        )
    batch_steps = merged[R3_STORE_BATCH_KEY]
    if type(batch_steps) is not int or not 0 <= batch_steps <= MAX_R3_STORE_BATCH_STEPS:
        raise ValueError(
            f"{R3_STORE_BATCH_KEY} must be an integer in [0, {MAX_R3_STORE_BATCH_STEPS}] (engine steps the R3 of "
            f"running requests may wait to be sent in one store call; 0 sends it every step), got {batch_steps!r}"
        )
    return merged


def refuse_lazy_offload(extra_config: dict[str, Any], kv_cache_config: Any, routed_experts: bool) -> None:
    """Refuse LMCache's lazy offload where lmcache_r3 cannot serve it (read as LMCache 0.5.6 reads it).

    Raises:
        ValueError: lazy offload on a hybrid model (its deferred stores know nothing of the null-block fixes), or
            with routed experts on (its stores come after the request finished, where no R3 store follows, so
            every lazily stored chunk would lack its R3 and every LMCache hit on it would be dropped).
    """
    if not extra_config.get(LAZY_OFFLOAD_KEY, False):
        return
    if _num_kv_groups(kv_cache_config) > 1:
        raise ValueError(f"{LAZY_OFFLOAD_KEY} is not supported with hybrid models by lmcache_r3; remove it")
    if routed_experts:
        raise ValueError(
            f"{LAZY_OFFLOAD_KEY} stores a request's KV after it finished, when vLLM is about to evict its blocks, "
            "and lmcache_r3 stores routed experts with the KV stores made while the request runs: every lazily "
            f"stored chunk would lack its R3 and every LMCache hit on it would be dropped. Remove {LAZY_OFFLOAD_KEY}, "
            f'or set "{ROUTED_EXPERTS_KEY}": false in kv_connector_extra_config.'
        )


def routed_experts_profile(vllm_config: Any, enabled: bool, say_why: bool = True) -> R3Profile | None:
    """The R3 row profile of the served model, or None when routed experts are off (a dense model, or asked off).

    ``say_why`` logs the one line that says a dense model runs without routed experts (the scheduler role says it;
    the worker roles stay quiet, so a deployment logs it once).

    Raises:
        ValueError: vLLM's own ``enable_return_routed_experts`` is on as well (two capturers on one router), or
            pipeline parallelism (each stage captures only its own layers; the rows would be partly zero).
    """
    if vllm_config.aux_output_config.enable_return_routed_experts:
        raise ValueError(
            "vLLM's enable_return_routed_experts is on, and lmcache_r3's connector returns routed experts itself "
            "(through kv_transfer_params, with LMCache hits included). Turn vLLM's off (drop "
            '--enable-return-routed-experts), or set "lmcache_r3.routed_experts": false in kv_connector_extra_config.'
        )
    if not enabled:
        return None
    model_config = vllm_config.model_config
    num_experts = model_config.get_num_experts()
    if num_experts <= 0:
        if say_why:
            logger.info("lmcache_r3: %s has no MoE layers; routed experts are off, KV reuse is unchanged",
                        model_config.model)  # fmt: skip
        return None
    refusal = routed_experts_refusal(vllm_config)
    if refusal is not None:
        raise ValueError(
            f"lmcache_r3 cannot return routed experts for this engine: {refusal}. Change that, or set "
            '"lmcache_r3.routed_experts": false in kv_connector_extra_config.'
        )
    return R3Profile(
        num_layers=model_config.get_total_num_hidden_layers(),
        top_k=model_config.get_num_experts_per_tok(),
        num_experts=num_experts,
    )


def routed_experts_refusal(vllm_config: Any) -> str | None:
    """Why the engine's layout keeps routed experts from being captured exactly, or None when it does not."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        return (
            f"it runs {parallel.pipeline_parallel_size} pipeline stages, and each stage's capture holds only its own "
            "layers (rows missing the others would read as routing to expert 0); use pipeline_parallel_size 1"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name) > 1:
            return (
                f"{name} is {getattr(parallel, name)}, and a context-parallel rank's slot mapping covers only its "
                f"share of the tokens, in slots of its own; use {name} 1"
            )
    if parallel.use_ubatching:
        return (
            "it runs micro-batches (--enable-dbo, or --ubatch-size above 1), whose captures overwrite each other; "
            "turn them off"
        )
    if not current_platform.is_cpu() and vllm_config.use_v2_model_runner:
        return (
            "vLLM's Model Runner V2 hands the connector a step's output after the step's forward context is gone, so "
            "no captured row could be matched to its token; use the V1 runner: VLLM_USE_V2_MODEL_RUNNER=0"
        )
    return None


def mirrored_group(kv_cache_config: Any) -> int | None:
    """The KV cache group whose slots key the R3 slot mirror: the first group vLLM keeps every block of until the
    request ends (full attention); None when the model has none. Rows kept in the slots of a block vLLM frees while
    the request runs (a window passed it) could be another request's by the time they are read."""
    if not _num_kv_groups(kv_cache_config):
        return 0
    groups = kv_cache_config.kv_cache_groups
    return next((i for i, group in enumerate(groups) if keeps_blocks_to_the_end(group)), None)


def refuse_r3_without_full_attention(kv_cache_config: Any, routed_experts: bool) -> None:
    """Refuse routed experts for a model without a full-attention KV cache group (see :func:`mirrored_group`).

    Raises:
        ValueError: routed experts are on and every group is windowed or recurrent.
    """
    if not routed_experts or mirrored_group(kv_cache_config) is not None:
        return
    kinds = ", ".join(group_kinds(kv_cache_config))
    raise ValueError(
        "lmcache_r3 keeps a request's routed experts in the slots of a full-attention KV cache group, and this "
        f"model has none (its groups: {kinds}); vLLM frees windowed and recurrent blocks while a request runs, so "
        'rows kept there could be another request\'s. Set "lmcache_r3.routed_experts": false in '
        "kv_connector_extra_config to serve it with KV reuse only."
    )


def first_server_url(extra: dict[str, Any]) -> str:
    urls = extra.get("lmcache.mp.server_urls")
    if urls:
        first = (urls if isinstance(urls, list) else str(urls).split(","))[0].strip()
    else:
        first = f"{extra.get('lmcache.mp.host', 'tcp://localhost')}:{extra.get('lmcache.mp.port', 5555)}"
    return first if "://" in first else f"tcp://{first}"
