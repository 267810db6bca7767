"""Fixtures of the routed-experts tests."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def hf_router(tiny_moe):
    """The routing HF transformers computes for a token sequence: ``[len - 1, layers, top_k]``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    top_k = model.config.num_experts_per_tok

    def rows(tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.tensor([tokens[:-1].tolist()]), output_router_logits=True)
        logits = [layer.reshape(-1, layer.shape[-1]) for layer in out.router_logits]
        per_layer = [torch.topk(layer, top_k, dim=-1).indices for layer in logits]
        return torch.stack(per_layer, dim=1).numpy()

    return rows
