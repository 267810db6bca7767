"""What the connector hands LMCache's connector: server address from the config file, transfer mode for hybrids."""

from types import SimpleNamespace

import pytest

from lmcache_r3.mp.connector_config import (
    LAZY_OFFLOAD_KEY,
    R3_STORE_BATCH_KEY,
    R3_TIMEOUT_KEY,
    ROUTED_EXPERTS_KEY,
    SEPARATE_GROUPS_KEY,
    TRANSFER_MODE_KEY,
    refuse_lazy_offload,
    resolve_extra_config,
)


def groups(n: int):
    return SimpleNamespace(kv_cache_groups=[object()] * n)


@pytest.fixture(autouse=True)
def no_config_file(monkeypatch):
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)


@pytest.mark.parametrize(
    ("num_groups", "explicit_mode", "expected_mode"),
    [
        pytest.param(1, None, None, id="dense-keeps-the-platform-default"),
        pytest.param(1, "engine_driven", "engine_driven", id="dense-engine-driven-allowed"),
        pytest.param(2, None, "lmcache_driven", id="hybrid-defaults-to-lmcache-driven"),
        pytest.param(2, "lmcache_driven", "lmcache_driven", id="hybrid-lmcache-driven"),
    ],
)
def test_transfer_mode(num_groups, explicit_mode, expected_mode):
    extra = {} if explicit_mode is None else {TRANSFER_MODE_KEY: explicit_mode}
    assert resolve_extra_config(extra, groups(num_groups)).get(TRANSFER_MODE_KEY) == expected_mode


def test_hybrid_with_engine_driven_is_refused_naming_the_mode_that_works():
    with pytest.raises(ValueError, match='Set "lmcache.mp.mp_transfer_mode": "lmcache_driven"'):
        resolve_extra_config({TRANSFER_MODE_KEY: "engine_driven"}, groups(2))


def test_server_address_and_flags_come_from_the_config_file(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("server: {port: 6500, http_port: 6501, extra_args: [--separate-object-groups]}\n")
    merged = resolve_extra_config({"lmcache_r3.config_file": str(file)}, groups(1))
    assert merged["lmcache.mp.port"] == 6500
    assert merged[SEPARATE_GROUPS_KEY] is True
    explicit = resolve_extra_config({"lmcache_r3.config_file": str(file), SEPARATE_GROUPS_KEY: False}, groups(1))
    assert explicit[SEPARATE_GROUPS_KEY] is False


@pytest.mark.parametrize(
    ("lazy", "num_groups", "routed_experts", "refusal"),
    [
        pytest.param(False, 2, True, None, id="no-lazy-offload-nothing-refused"),
        pytest.param(True, 1, False, None, id="lazy-offload-of-a-dense-model-without-r3-is-lmcaches"),
        pytest.param(True, 1, True, r'lack its R3.*"lmcache_r3\.routed_experts": false', id="lazy-offload-with-r3"),
        pytest.param(True, 2, False, "not supported with hybrid models", id="lazy-offload-of-a-hybrid-model"),
        pytest.param(True, 2, True, "not supported with hybrid models", id="hybrid-is-said-first"),
    ],
)
def test_lazy_offload_is_refused_where_lmcache_r3_cannot_serve_it(lazy, num_groups, routed_experts, refusal):
    extra = {LAZY_OFFLOAD_KEY: lazy}
    if refusal is None:
        refuse_lazy_offload(extra, groups(num_groups), routed_experts)
    else:
        with pytest.raises(ValueError, match=refusal):
            refuse_lazy_offload(extra, groups(num_groups), routed_experts)


@pytest.mark.parametrize(
    ("file_value", "explicit", "expected"),
    [
        pytest.param(None, None, 8, id="default-eight-steps"),
        pytest.param(0, None, 0, id="file-zero-sends-every-step"),
        pytest.param(3, 5, 5, id="explicit-wins-over-the-file"),
        pytest.param(None, -1, "must be an integer in \\[0, 1024\\]", id="negative-refused"),
        pytest.param(None, 2.5, "got 2.5", id="fraction-refused"),
        pytest.param(None, True, "got True", id="bool-refused"),
    ],
)
def test_r3_store_batch_steps(tmp_path, file_value, explicit, expected):
    extra = {}
    if file_value is not None:
        file = tmp_path / "c.yaml"
        file.write_text(f"connector: {{r3_store_batch_steps: {file_value}}}\n")
        extra["lmcache_r3.config_file"] = str(file)
    if explicit is not None:
        extra[R3_STORE_BATCH_KEY] = explicit
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=f"{R3_STORE_BATCH_KEY}.*{expected}"):
            resolve_extra_config(extra, groups(1))
    else:
        assert resolve_extra_config(extra, groups(1))[R3_STORE_BATCH_KEY] == expected


def test_a_bad_r3_store_batch_steps_in_the_file_names_the_field(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("connector: {r3_store_batch_steps: -2}\n")
    with pytest.raises(ValueError, match="r3_store_batch_steps"):
        resolve_extra_config({"lmcache_r3.config_file": str(file)}, groups(1))


@pytest.mark.parametrize(
    ("key", "value", "refusal"),
    [
        pytest.param(ROUTED_EXPERTS_KEY, "false", "must be true or false", id="switch-as-a-string"),
        pytest.param(ROUTED_EXPERTS_KEY, 1, "must be true or false", id="switch-as-a-number"),
        pytest.param(R3_TIMEOUT_KEY, 0, "must be a number of seconds > 0", id="zero-timeout"),
        pytest.param(R3_TIMEOUT_KEY, -1.0, "got -1.0", id="negative-timeout"),
        pytest.param(R3_TIMEOUT_KEY, float("nan"), "got nan", id="nan-timeout"),
        pytest.param(R3_TIMEOUT_KEY, "5", "got '5'", id="timeout-as-a-string"),
        pytest.param(R3_TIMEOUT_KEY, 2.5, None, id="fractional-timeout-accepted"),
        pytest.param(ROUTED_EXPERTS_KEY, False, None, id="switch-off-accepted"),
    ],
)
def test_a_bad_routed_experts_switch_or_r3_timeout_is_refused_naming_the_key(key, value, refusal):
    # "false" as a string would be truthy: routed experts would stay on while the user asked them off.
    if refusal is None:
        assert resolve_extra_config({key: value}, groups(1))[key] == value
        return
    with pytest.raises(ValueError, match=f"{key}.*{refusal}"):
        resolve_extra_config({key: value}, groups(1))


@pytest.mark.parametrize(
    ("file", "override", "refused"),
    [
        pytest.param("tiers: [{type: fs, base_path: /l2}]\n", 1.0, True, id="below-the-servers-tier-bound"),
        pytest.param("tiers: [{type: fs, base_path: /l2}]\n", 4.0, True, id="equal-to-it"),
        pytest.param("tiers: [{type: fs, base_path: /l2}]\n", 4.5, False, id="above-it"),
        pytest.param("tiers: [{type: fs, base_path: /l2}]\nr3: {tier_timeout_s: 0.5}\n", 1.0, False, id="explicit"),
        pytest.param("tiers: []\n", 1.0, False, id="no-tier-nothing-to-wait-for"),
        pytest.param("tiers: [{type: fs, base_path: /l2}]\nr3: {enabled: false}\n", 1.0, False, id="r3-off"),
    ],
)
def test_an_engines_r3_timeout_must_outlast_the_servers_wait_for_its_tiers(tmp_path, file, override, refused):
    """The server waits for its tiers up to 0.8 x the file's connector.r3_timeout_s (5 s: 4 s) on one of its few
    threads; an engine that gives up sooner leaves that thread waiting for nobody while KV lookups queue."""
    path = tmp_path / "c.yaml"
    path.write_text(file)
    extra = {"lmcache_r3.config_file": str(path), R3_TIMEOUT_KEY: override}
    if refused:
        with pytest.raises(ValueError, match=rf"{R3_TIMEOUT_KEY} \({override}\) must be above .* 4 s"):
            resolve_extra_config(extra, groups(1))
    else:
        assert resolve_extra_config(extra, groups(1))[R3_TIMEOUT_KEY] == override


def _spec(kind: str, head_size: int = 32):
    import torch
    from vllm.v1 import kv_cache_interface as k

    common = {"block_size": 32, "num_kv_heads": 2, "head_size": head_size, "dtype": torch.float32}
    extra = {
        "SlidingWindowSpec": {"sliding_window": 64},
        "RSWASpec": {"rswa_window": 64},
        "ChunkedLocalAttentionSpec": {"attention_chunk_size": 64},
    }
    if kind == "MambaSpec":
        return k.MambaSpec(block_size=32, shapes=((4, 256),), dtypes=(torch.float32,), mamba_cache_mode="align")
    return getattr(k, kind)(**common, **extra.get(kind, {}))


def _config(*group_specs):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(group_specs)]
    )


def _uniform(kind: str):
    """Layers of one type with different page sizes in one group, as vLLM's worker config keeps them."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    return UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"a": _spec(kind, 32), "b": _spec(kind, 64)})


@pytest.mark.parametrize(
    ("groups", "mirrored", "frees"),
    [
        pytest.param(lambda: [_spec("FullAttentionSpec")], 0, False, id="dense"),
        pytest.param(lambda: [_spec("MLAAttentionSpec")], 0, False, id="mla"),
        pytest.param(lambda: [_spec("SinkFullAttentionSpec")], 0, False, id="sink-full-attention"),
        pytest.param(lambda: [_uniform("FullAttentionSpec")], 0, False, id="uniform-full-attention"),
        pytest.param(lambda: [_spec("SlidingWindowSpec"), _spec("FullAttentionSpec")], 1, True, id="window-first"),
        pytest.param(lambda: [_spec("FullAttentionSpec"), _spec("MambaSpec")], 0, True, id="hybrid-mamba"),
        pytest.param(lambda: [_spec("RSWASpec"), _spec("FullAttentionSpec")], 1, True, id="rswa-frees-its-gap"),
        pytest.param(lambda: [_spec("ChunkedLocalAttentionSpec")], None, True, id="chunked-local-only"),
        pytest.param(lambda: [_uniform("SlidingWindowSpec")], None, True, id="uniform-windows-only"),
    ],
)
def test_the_r3_mirror_uses_the_first_group_vllm_never_frees_mid_request(groups, mirrored, frees):
    from lmcache_r3.mp.connector_config import mirrored_group, refuse_r3_without_full_attention
    from lmcache_r3.mp.stock_adapter import frees_blocks_mid_request

    config = _config(*groups())
    assert mirrored_group(config) == mirrored
    assert frees_blocks_mid_request(config) is frees
    refuse_r3_without_full_attention(config, routed_experts=False)  # KV reuse alone is always served
    if mirrored is None:
        with pytest.raises(ValueError, match=r'has none \(its groups: \w+Spec\).*"lmcache_r3\.routed_experts": false'):
            refuse_r3_without_full_attention(config, routed_experts=True)
    else:
        refuse_r3_without_full_attention(config, routed_experts=True)
