"""The two locally built tiny MoE shapes: distinct routing profiles, rebuilt only when the shape changes."""

from dataclasses import replace

from transformers import AutoConfig

from lmcache_r3.demo.model import SMALL, WIDE, build_tiny_moe


def test_shapes_differ_in_everything_routing_depends_on():
    assert SMALL.num_layers != WIDE.num_layers
    assert SMALL.num_experts != WIDE.num_experts
    assert SMALL.top_k != WIDE.top_k
    assert SMALL.num_experts <= 256 < WIDE.num_experts  # uint8 and uint16 routing


def test_fingerprint_changes_with_any_field():
    assert replace(SMALL, top_k=3).fingerprint != SMALL.fingerprint
    assert replace(SMALL, seed=5).fingerprint != SMALL.fingerprint
    assert replace(SMALL).fingerprint == SMALL.fingerprint


def test_built_checkpoint_has_the_shape_and_is_reused(tmp_path):
    first = build_tiny_moe(SMALL, tmp_path)
    config = AutoConfig.from_pretrained(first)
    assert config.model_type == "qwen3_moe"
    assert config.num_hidden_layers == SMALL.num_layers
    assert config.num_experts == SMALL.num_experts
    assert config.num_experts_per_tok == SMALL.top_k
    assert config.head_dim == 32
    stamp = (first / "config.json").stat().st_mtime_ns
    assert build_tiny_moe(SMALL, tmp_path) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left behind
