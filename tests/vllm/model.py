"""The model of the vLLM engine tests, for the test process and the trainer process alike: a
4.5 M-parameter Qwen2 made with ``transformers`` (random weights, bf16), and a real training
step (LM loss on random tokens, AdamW)."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, dtype="bfloat16", initializer_range=0.1)
    return Qwen2ForCausalLM(config).to(torch.bfloat16)


def adamw_step(model, optimizer, generator) -> None:
    """One real training step: every tensor changes (at the tests' lr of 1e-2)."""
    tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=generator)
    loss = model(input_ids=tokens, labels=tokens).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
