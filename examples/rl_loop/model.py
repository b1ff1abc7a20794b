"""What the trainer and the inference process of the every-step example share: the model (a
tiny Qwen2 causal LM in bf16, random init from a seed: nothing is downloaded), the digest of the
weights a process holds, and one JSON line per event on stdout."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import collective.torch  # noqa: E402
from collective.digest import array_digest, combined_digest  # noqa: E402

# About 0.4 M parameters (0.8 MB in bf16): the shape of a Qwen2 (grouped-query attention, tied
# embeddings), small enough for a 2-core machine.
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def build(seed: int) -> Qwen2ForCausalLM:
    """The example's model with random weights drawn from ``seed``, in bf16, on the CPU."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    return model


def weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """A copy of the weights' bytes (what the next step is compared with)."""
    return {name: a.copy() for name, a in collective.torch.module_state(model).items()}


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of the weights the module's own tensors hold (read from them, not from what
    collective says it applied): equal on both sides when they hold the same bits."""
    return combined_digest((name, array_digest(a)) for name, a in collective.torch.module_state(model).items())


def changed(before: dict[str, np.ndarray], model: torch.nn.Module) -> tuple[int, int]:
    """(elements whose bits differ from ``before``, elements) over the module's weights."""
    now = collective.torch.module_state(model)
    count = sum(int(np.count_nonzero(before[n].view(f"u{a.itemsize}") != a.view(f"u{a.itemsize}"))) for n, a in now.items())
    return count, sum(a.size for a in now.values())


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)
