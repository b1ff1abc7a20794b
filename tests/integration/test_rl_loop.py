"""The every-step example with real processes: examples/rl_loop/trainer.py trains a tiny Qwen2
in bf16 with AdamW and publishes every step; examples/rl_loop/inference.py generates with
Hugging Face ``transformers`` and applies each step between generations. Every step the
inference process applied must be the trainer's of that step, bit for bit: the subscription's
manifest digest and the digest of the inference model's own tensors against the trainer's."""

from __future__ import annotations

import json

import pytest

from tests.clusters import TOKEN
from tests.framework.conftest import require
from tests.procs import Proc, wait_for

require("torch")
require("transformers")

STEPS = 5


def events(proc: Proc) -> list[dict]:
    """The JSON lines the process printed (read from its log: also once it was killed)."""
    return [json.loads(ln) for ln in proc.log.read_text().splitlines() if ln.startswith("{")]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_inference_holds_the_trainers_weights_of_every_step_it_applies(tmp_path):
    held = tmp_path / "held"
    env = {"COLLECTIVE_TOKEN": TOKEN}
    trainer = Proc(["examples/rl_loop/trainer.py", "--steps", str(STEPS), "--wait-for", str(held),
                    "--timeout", "300", "--linger", "300"], tmp_path / "trainer.log", env=env)
    inference = None
    try:
        wait_for(trainer, '"event": "publishing"', timeout=180)
        address = events(trainer)[0]["address"]
        inference = Proc(["examples/rl_loop/inference.py", "--source", address, "--until-step", str(STEPS),
                          "--held", str(held), "--timeout", "400"], tmp_path / "inference.log", env=env)
        assert inference.wait(480) == 0, inference.output()
        wait_for(trainer, '"event": "done"', timeout=60)
    finally:
        trainer.kill()
        if inference is not None:
            inference.kill()
    published = {e["step"]: e for e in events(trainer) if e["event"] in ("publishing", "step")}
    applied = [e for e in events(inference) if e["event"] == "step"]
    assert sorted(published) == list(range(STEPS + 1))
    # Lock step: the trainer trains step k once step k-1 is held, so every step is applied, in
    # order, each (after the first fetch) as a delta from the step before.
    assert [e["step"] for e in applied] == list(range(STEPS + 1)), inference.log.read_text()
    for e in applied:
        want = published[e["step"]]
        assert (e["manifest"], e["weights"]) == (want["manifest"], want["weights"]), (e, want)
    assert [e["kind"] for e in applied] == ["full"] + ["delta"] * STEPS
    for e in applied[1:]:
        assert e["generations"] >= 1 and len(e["tokens"]) == 2  # it generated between updates
        # What the inference saw change is what the trainer's step changed (0 < it < 1: bf16
        # absorbs most of an AdamW step at this learning rate).
        assert e["changed_fraction"] == published[e["step"]]["changed_fraction"]
        assert 0 < e["changed_fraction"] < 1
    # The weights moved: the digests of consecutive steps differ.
    assert len({e["weights"] for e in applied}) == STEPS + 1
    done = [e for e in events(inference) if e["event"] == "done"]
    assert done and done[0]["step"] == STEPS
