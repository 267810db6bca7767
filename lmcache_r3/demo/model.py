"""Tiny random-weight Qwen3-MoE checkpoints built locally, for the demo and the tests (nothing is downloaded).

A *model shape* fixes everything routed experts depend on: decoder layers, experts, top-k. Two shapes exist so
that no code is tuned to one model: ``SMALL`` (2 layers, 8 experts, top-2, uint8 routing) and ``WIDE`` (4 layers,
300 experts, top-3, so its routing needs uint16). ``MEDIUM`` (8 layers, 32 experts, top-4, hidden 512) is for
benchmarks whose engine steps should be the model's compute more than vLLM's own per-step work. Attention uses
head_dim 32 (the CPU backend rejects 16; ``MEDIUM``: 64) and the tokenizer is a word-level vocabulary
``w0 .. w1019`` built in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

#: Token ids below this are special tokens (<pad>, <s>, </s>, <unk>); prompts should use ids >= it.
FIRST_WORD_ID = 4


@dataclass(frozen=True)
class MoEShape:
    """What a tiny model's routing looks like."""

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int = 1024
    hidden_size: int = 64
    head_dim: int = 32
    moe_intermediate_size: int = 32
    max_position_embeddings: int = 4096
    seed: int = 0

    @property
    def fingerprint(self) -> str:
        """Changes whenever any field changes; names the cache directory."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


SMALL = MoEShape(name="tiny-qwen3moe", num_layers=2, num_experts=8, top_k=2)
WIDE = MoEShape(name="tiny-qwen3moe-wide", num_layers=4, num_experts=300, top_k=3, seed=1)
MEDIUM = MoEShape(
    name="small-qwen3moe",
    num_layers=8,
    num_experts=32,
    top_k=4,
    hidden_size=512,
    head_dim=64,
    moe_intermediate_size=256,
)
"""Big enough that a CPU engine step is mostly the model's own compute (benchmarks); builds in a few seconds."""
SHAPES = {"small": SMALL, "wide": WIDE, "medium": MEDIUM}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmcache_r3" / "models"


def build_tiny_moe(shape: MoEShape = SMALL, cache_dir: Path | None = None) -> Path:
    """Directory of a ``save_pretrained`` checkpoint + tokenizer for ``shape``; built once, then reused.

    The directory is written under a temporary name and renamed, so a half-written model is never reused.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = root / f"{shape.name}-{shape.fingerprint}"
    if (dest / "config.json").exists() and (dest / "tokenizer.json").exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{dest.name}.{os.getpid()}.tmp"
    _write_checkpoint(shape, staging)
    try:
        os.rename(staging, dest)
    except OSError:
        # Another process finished the same model first; theirs is identical.
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return dest


def _write_checkpoint(shape: MoEShape, out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for i in range(shape.vocab_size - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    config = Qwen3MoeConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=2 * shape.hidden_size,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=shape.head_dim,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(shape.seed)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(out)
    hf_tokenizer.save_pretrained(out)
