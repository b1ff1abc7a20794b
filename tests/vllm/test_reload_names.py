"""Which checkpoint tensors a step reloads (``collective.vllm.reload_names``): every tensor of
each of vLLM's layer groups that holds a changed one, so a fused module (q/k/v, gate/up) always
gets all its parts in one update."""

from __future__ import annotations

import warnings

from tests.vllm.conftest import require_vllm

with warnings.catch_warnings():
    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.simplefilter("ignore", category)
    require_vllm()
    from collective.vllm import reload_names

LAYER = ["self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
         "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
         "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
NAMES = ["model.embed_tokens.weight", *(f"model.layers.{i}.{n}" for i in range(3) for n in LAYER),
         "model.norm.weight", "lm_head.weight"]


def test_a_changed_q_proj_reloads_its_whole_decoder_layer_k_and_v_included_and_nothing_else():
    assert reload_names(NAMES, {"model.layers.1.self_attn.q_proj.weight"}) == [f"model.layers.1.{n}" for n in LAYER]


def test_changes_in_the_embeddings_and_lm_head_reload_their_groups_in_checkpoint_order():
    got = reload_names(NAMES, {"lm_head.weight", "model.embed_tokens.weight"})
    assert got == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def test_nothing_changed_reloads_nothing_and_everything_changed_reloads_everything():
    assert reload_names(NAMES, set()) == []
    assert reload_names(NAMES, set(NAMES)) == NAMES
