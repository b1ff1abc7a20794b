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


def run_loop(tmp_path, trainer_args: list[str], inference_args: list[str]) -> tuple[dict[int, dict], list[dict]]:
    """Run the trainer and the inference process to the end; (the trainer's events by step, the
    inference's step events in order). Both killed by pid, whatever happens."""
    env = {"COLLECTIVE_TOKEN": TOKEN}
    trainer = Proc(["examples/rl_loop/trainer.py", "--steps", str(STEPS), "--linger", "300", *trainer_args],
                   tmp_path / "trainer.log", env=env)
    inference = None
    try:
        wait_for(trainer, '"event": "publishing"', timeout=180)
        address = events(trainer)[0]["address"]
        inference = Proc(["examples/rl_loop/inference.py", "--source", address, "--until-step", str(STEPS),
                          "--timeout", "400", *inference_args], tmp_path / "inference.log", env=env)
        assert inference.wait(480) == 0, inference.output()
        wait_for(trainer, '"event": "done"', timeout=60)
    finally:
        trainer.kill()
        if inference is not None:
            inference.kill()
    published = {e["step"]: e for e in events(trainer) if e["event"] in ("publishing", "step")}
    assert sorted(published) == list(range(STEPS + 1))
    applied = [e for e in events(inference) if e["event"] == "step"]
    for e in applied:  # every step applied is the trainer's of that step, bit for bit
        want = published[e["step"]]
        assert (e["manifest"], e["weights"]) == (want["manifest"], want["weights"]), (e, want)
    done = [e for e in events(inference) if e["event"] == "done"]
    assert done and done[0]["step"] == STEPS
    return published, applied


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_inference_holds_the_trainers_weights_of_every_step_it_applies(tmp_path):
    held = tmp_path / "held"
    published, applied = run_loop(tmp_path, ["--wait-for", str(held), "--timeout", "300"], ["--held", str(held)])
    # Lock step: the trainer trains step k once step k-1 is held, so every step is applied, in
    # order, each (after the first fetch) as a delta from the step before.
    assert [e["step"] for e in applied] == list(range(STEPS + 1)), applied
    assert [e["kind"] for e in applied] == ["full"] + ["delta"] * STEPS
    assert [e["applied"] for e in applied[1:]] == [[[k, "delta"]] for k in range(1, STEPS + 1)]
    for e in applied[1:]:
        assert e["generations"] >= 1 and len(e["tokens"]) == 2  # it generated between updates
        # What the inference saw change is what the trainer's step changed (0 < it < 1: bf16
        # absorbs most of an AdamW step at this learning rate), in the bytes the trainer served.
        want = published[e["step"]]
        assert (e["changed_fraction"], e["delta_bytes"]) == (want["changed_fraction"], want["delta_bytes"])
        assert 0 < e["changed_fraction"] < 1 and want["delta_bytes"] < want["state_bytes"]
    # The weights moved: the digests of consecutive steps differ.
    assert len({e["weights"] for e in applied}) == STEPS + 1


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_trainer_running_ahead_is_followed_to_its_last_step(tmp_path):
    """Asynchronous RL: the trainer may run 2 steps ahead of the inference process, so that
    process may be behind when it applies (it then takes the newest step waiting); whatever
    it applied is the trainer's of that step, bit for bit, and it ends holding the last."""
    held = tmp_path / "held"
    _, applied = run_loop(tmp_path, ["--wait-for", str(held), "--max-lag", "2", "--timeout", "300"],
                          ["--held", str(held)])
    steps = [e["step"] for e in applied]
    assert steps[0] == 0 and steps == sorted(set(steps)) and steps[-1] == STEPS
    assert {e["kind"] for e in applied} <= {"full", "delta"}
    # Each apply wrote the steps after the one held, up to the one it reports, none twice.
    written = [k for e in applied[1:] for k, _ in e["applied"]]
    assert written == sorted(set(written)) and written[-1] == STEPS
    assert all(e["applied"][-1][0] == e["step"] for e in applied[1:])


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    proc = Proc(["examples/rl_loop/inference.py", "--source", "127.0.0.1:1", "--until-step", "-1"],
                tmp_path / "inference.log")
    try:
        assert proc.wait(90) == 2
    finally:
        proc.kill()
    out = proc.log.read_text().strip()
    assert out == "error: --until-step must be >= 0, --new-tokens >= 1, --timeout > 0", out
