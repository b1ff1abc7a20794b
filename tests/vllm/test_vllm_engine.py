"""collective as vLLM's weight-transfer engine, with real vLLM on CPU (vLLM's CPU build).

A 4.5 M-parameter Qwen2 is made here with ``transformers`` (random weights, bf16) and served by
``LLM(weight_transfer_config={"backend": "collective"})``: the backend comes from collective's
``vllm.general_plugins`` entry point, loaded by vLLM in its engine core, a process of its own.
The trainer (this process: the model, two real AdamW steps on random tokens and a sparse
change to one layer, vLLM's trainer engine over the LLM) publishes each step; after each update the engine's greedy tokens must
equal those of a FRESH engine started from the trainer's weights of that step
(``save_pretrained``), and the engine must report the trainer's step and manifest digest.
The same holds with the trainer in a process of its own that publishes with ``collective``
alone (tests/vllm/trainer.py), the update driven by vLLM's calls.
"""

from __future__ import annotations

import gc
import json
import os
import time
import warnings

import pytest

from tests.procs import Proc, wait_until
from tests.vllm.conftest import require_vllm

# torch, transformers and vLLM warn about their own internals (torch.jit deprecations, ...);
# the suite's warnings-as-errors is for this project's code, so theirs are let through here.
THIRD_PARTY = (DeprecationWarning, FutureWarning, UserWarning)
with warnings.catch_warnings():
    for category in THIRD_PARTY:
        warnings.simplefilter("ignore", category)
    require_vllm()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from collective.vllm import CollectiveTrainerInitInfo, LLMClient, weight_version
    from tests.vllm.model import adamw_step, qwen2

pytestmark = [pytest.mark.timeout(1200), *(pytest.mark.filterwarnings(f"ignore::{c.__name__}") for c in THIRD_PARTY)]

STEPS = 3
TOKEN = "vllm-engine-test-token"
# One engine's settings, live and fresh alike: no tokenizer (prompts are token ids), eager (no
# compilation on CPU), a 64 MiB KV cache (vLLM's CPU default takes most of the machine).
ENGINE = dict(skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              seed=0, kv_cache_memory_bytes=64 << 20)
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [100, 200, 300]},
           {"prompt_token_ids": list(range(7, 400, 13))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, detokenize=False)


def _greedy(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _close(llm) -> None:
    """Stop the engine core (its process) and free this process's side; vLLM leaves its ZMQ
    context open after shutdown (a ResourceWarning at exit, an error under the suite's filters)."""
    core = llm.llm_engine.engine_core
    core.shutdown()
    core.ctx.destroy(linger=0)
    del llm, core
    gc.collect()


def _fresh_greedy(path) -> tuple[list[list[int]], float]:
    started = time.perf_counter()
    llm = LLM(model=str(path), **ENGINE)
    try:
        return _greedy(llm), time.perf_counter() - started
    finally:
        _close(llm)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The trainer's model at step 0, its checkpoint, an LLM serving it with the collective
    backend, and the trainer engine (published at step 0, the engine subscribed)."""
    root = tmp_path_factory.mktemp("vllm-engine")
    model = qwen2()
    assert 4.0e6 < sum(p.numel() for p in model.parameters()) < 5.0e6
    model.save_pretrained(root / "step0")
    with pytest.MonkeyPatch.context() as mp:
        # The token reaches both sides through the environment, never through vLLM's RPCs.
        mp.setenv("COLLECTIVE_TOKEN", TOKEN)
        started = time.perf_counter()
        llm = LLM(model=str(root / "step0"), weight_transfer_config={"backend": "collective"},
                  worker_extension_cls="collective.vllm.CollectiveWorkerExtension", **ENGINE)
        engine_start = time.perf_counter() - started
        started = time.perf_counter()
        trainer = WeightTransferTrainerFactory.trainer_init(
            CollectiveTrainerInitInfo(rank=0, step=0), client=LLMClient(llm), source=ModuleSource(model))
        subscribe = time.perf_counter() - started
    timings = [f"engine start {engine_start:.1f} s, trainer_init (publish + the engine's full fetch) {subscribe:.2f} s"]
    try:
        yield {"root": root, "model": model, "llm": llm, "trainer": trainer, "timings": timings}
    finally:
        trainer.shutdown()
        _close(llm)


def _held(llm) -> dict:
    (held,) = llm.collective_rpc("collective_weights")
    return held


def _show(capsys, lines: list[str]) -> None:
    """The timings, printed past pytest's capture (the issue's note quotes them)."""
    with capsys.disabled():
        print("", *(f"vllm engine test: {line}" for line in lines), sep="\n")


def _sparse_change(model, generator) -> set[str]:
    """2% of the elements of decoder layer 1's tensors and of lm_head moved (a step that
    touches a few layers); returns the names of the tensors changed."""
    names = {n for n, _ in model.named_parameters() if n.startswith("model.layers.1.") or n == "lm_head.weight"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in names:
                mask = torch.rand(p.shape, generator=generator) < 0.02
                p[mask] += (torch.randn(int(mask.sum()), generator=generator) * 0.1).to(p.dtype)
    return names


def test_each_trainer_step_reaches_the_engine_and_generates_as_a_fresh_engine_on_that_step(served, capsys):
    """Steps 1 and 2: a real AdamW step (every tensor changes; the first update after the
    subscription loads every tensor anyway). Step 3: a sparse change to one decoder layer and
    lm_head: its delta is a small part of the state, and only those layer groups are reloaded."""
    model, llm, trainer, root = served["model"], served["llm"], served["trainer"], served["root"]
    timings = served["timings"]
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    before = _greedy(llm)
    for step in range(1, STEPS + 1):
        changed = _sparse_change(model, generator) if step == STEPS else adamw_step(model, optimizer, generator)
        model.save_pretrained(root / f"step{step}")
        sent = trainer.send_weights(step)
        held = _held(llm)
        tokens = _greedy(llm)
        fresh, fresh_seconds = _fresh_greedy(root / f"step{step}")
        last = held["last"]
        timings.append(f"step {step}: publish {sent['publish_seconds']:.2f} s, update round "
                       f"{sent['update_seconds']:.2f} s (engine: {last['kind']} of {last['bytes']:,} of "
                       f"{state_bytes:,} bytes, apply {held['apply_seconds']:.3f} s, load "
                       f"{held['load_seconds']:.3f} s, {held['loaded_tensors']}/{held['tensors']} tensors "
                       f"reloaded), verify (fresh engine start + generate) {fresh_seconds:.1f} s")
        # The engine core is its own process: the plugin registered the backend there.
        assert held["pid"] != os.getpid()
        assert (held["step"], held["manifest_digest"]) == (step, sent["manifest_digest"])
        assert llm.get_weight_version() == weight_version(step, sent["manifest_digest"])
        assert last["kind"] == "delta"
        if changed is not None:
            assert held["changed_tensors"] == len(changed)
            # Decoder layer 1's group, and the tail's (the final norm with lm_head).
            assert held["loaded_tensors"] == len(changed) + 1 < held["tensors"]
            assert last["bytes"] < state_bytes // 10
        # The step changed what the model generates (else an update that loaded nothing would pass)...
        assert fresh != before, f"step {step}'s weights generate what step {step - 1}'s did"
        # ...and the live engine generates exactly what a fresh one on the trainer's weights does.
        assert tokens == fresh, f"step {step}: the live engine's greedy tokens differ from a fresh engine's"
        before = tokens
    _show(capsys, timings)


def test_an_update_whose_manifest_digest_differs_from_the_engines_is_refused_and_nothing_is_loaded(served):
    llm = served["llm"]
    held = _held(llm)
    tokens = _greedy(llm)
    client = LLMClient(llm)
    client.start_weight_update()
    with pytest.raises(Exception, match="manifest digest") as failed:
        client.update_weights({"step": held["step"] or 0, "manifest_digest": "0" * 32})
    assert "nothing loaded" in str(failed.value)
    assert _held(llm) == held
    assert _greedy(llm) == tokens


def test_an_update_to_a_step_never_published_times_out_naming_the_step_held_and_nothing_changes(served):
    llm = served["llm"]
    held = _held(llm)
    tokens = _greedy(llm)
    client = LLMClient(llm)
    client.start_weight_update()
    step = (held["step"] or 0) + 100
    with pytest.raises(Exception, match=f"step {step} did not arrive within 2 s; holding step {held['step'] or 0}"):
        client.update_weights({"step": step, "timeout": 2.0})
    assert _held(llm) == held
    assert _greedy(llm) == tokens


TRAINER_STEPS = 2


def _published(proc: Proc, count: int, timeout: float = 600.0) -> list[dict]:
    """The first ``count`` steps the trainer process said it published (its JSON lines)."""
    def lines() -> list[dict]:
        return [json.loads(ln) for ln in proc.output().splitlines() if ln.startswith('{"step"')]

    wait_until(lambda: len(lines()) >= count or proc.proc.poll() is not None,
               f"the trainer's step {count - 1}", timeout)
    assert len(lines()) >= count, f"the trainer exited with {proc.proc.returncode}:\n{proc.output()}"
    return lines()[:count]


def test_a_trainer_process_that_publishes_with_collective_drives_the_engine_through_vllms_update_calls(
        served, tmp_path, capsys):
    """The trainer is a process of its own, without vLLM (``collective.publish``, then
    ``Publication.update`` after each AdamW step); the engine is pointed at it
    (``init_weight_transfer_engine``: a new subscription, the first update loads every tensor)
    and each step goes through vLLM's own calls with the trainer's step and manifest digest."""
    llm, timings = served["llm"], served["timings"]
    proc = Proc(["-m", "tests.vllm.trainer", str(tmp_path), str(TRAINER_STEPS)], tmp_path / "trainer.log",
                env={"COLLECTIVE_TOKEN": TOKEN})
    try:
        (first,) = _published(proc, 1)
        client = LLMClient(llm)
        client.init_weight_transfer_engine({"sources": [first["address"]]})
        before = _greedy(llm)
        for step in range(1, TRAINER_STEPS + 1):
            (tmp_path / f"go{step}").touch()
            published = _published(proc, step + 1)[step]
            assert published["step"] == step
            started = time.perf_counter()
            client.start_weight_update()
            client.update_weights({"step": step, "manifest_digest": published["manifest_digest"]})
            client.finish_weight_update(weight_version(step, published["manifest_digest"]))
            update = time.perf_counter() - started
            held = _held(llm)
            tokens = _greedy(llm)
            fresh, fresh_seconds = _fresh_greedy(tmp_path / f"step{step}")
            timings.append(f"trainer process, step {step}: update round {update:.2f} s "
                           f"({held['last']['kind']} of {held['last']['bytes']:,} bytes, "
                           f"{held['loaded_tensors']}/{held['tensors']} tensors reloaded), verify {fresh_seconds:.1f} s")
            assert (held["step"], held["manifest_digest"]) == (step, published["manifest_digest"])
            assert fresh != before, f"step {step}'s weights generate what step {step - 1}'s did"
            assert tokens == fresh, f"step {step}: the live engine's greedy tokens differ from a fresh engine's"
            before = tokens
        (tmp_path / "done").touch()
        assert proc.wait(60) == 0, proc.output()
    finally:
        proc.kill()
    _show(capsys, timings[-TRAINER_STEPS:])
