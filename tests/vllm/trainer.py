"""A trainer process for tests/vllm: publishes the model with ``collective.publish`` (no vLLM
here), then takes STEPS AdamW steps. Before each step it waits for the test's file goN (the
engine has loaded the step before); after it, it saves the step's weights (``save_pretrained``,
for the test's fresh engine), publishes the step, waits until it is served and prints one JSON
line: ``{"step", "manifest_digest", "address"}``. It serves the last step until the file done.
The token comes from COLLECTIVE_TOKEN.

    python -m tests.vllm.trainer DIR STEPS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import collective
from tests.vllm.model import adamw_step, qwen2

GO_TIMEOUT = 600.0


def _state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + GO_TIMEOUT
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"trainer: no {path.name} within {GO_TIMEOUT:g} s")
        time.sleep(0.05)


def _said(pub) -> None:
    print(json.dumps({"step": pub.step, "manifest_digest": pub.manifest_digest, "address": pub.address}), flush=True)


def main(folder: Path, steps: int) -> None:
    model = qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(2)
    pub = collective.publish(_state(model), step=0, copy=True, bind="127.0.0.1:0", name="trainer")
    _said(pub)
    try:
        for step in range(1, steps + 1):
            _wait_for(folder / f"go{step}")
            adamw_step(model, optimizer, generator)
            model.save_pretrained(folder / f"step{step}")
            pub.update(_state(model), step=step)
            pub.wait()
            _said(pub)
        _wait_for(folder / "done")
    finally:
        pub.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
