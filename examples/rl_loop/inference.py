"""The inference process of the every-step example: Hugging Face generation on the trainer's
model, following its publication step by step, every step verified after it is applied.

    python examples/rl_loop/inference.py --source ADDRESS --until-step 5 --token secret

Builds the same architecture (``model.build``: its own random weights, replaced at once),
subscribes with ``collective.torch.subscribe`` (the trainer's current step is fetched straight
into the model's parameters, verified), then loops: a greedy ``model.generate`` on fixed
token-id prompts, then ``apply()``, which writes the newest verified step into the same
``Parameter`` objects in place between two generations (never during one). Prints one JSON
line per step it holds: ``{"event": "step", "step", "manifest", "weights", "changed_fraction",
"delta_bytes", "kind", "applied", "apply_seconds", "generations", "tokens"}``: the
subscription's manifest digest, the digest its model's own tensors hold
(``model.weights_digest``), the fraction of elements that changed since the step held before,
the bytes received for the step and how (``delta`` or ``full``), the (step, kind) pairs
``apply`` wrote (several when it was behind; bytes and kind are the last one's), the seconds
``apply`` took, the generations run since the step before and the last one's tokens.
Ends once it holds ``--until-step`` (exit 0), or after ``--timeout`` seconds (exit 1).
``--held FILE``: after each step it holds, the step is written to FILE (whole, by rename), for
the trainer's ``--wait-for FILE`` (lock step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from model import build, changed, say, weights, weights_digest

import collective.torch
from collective.entry import run_main
from collective.errors import UsageError

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", required=True, help="the trainer's publication, HOST:PORT")
    p.add_argument("--until-step", type=int, required=True, help="stop once this step is held")
    p.add_argument("--token", default=None, help="the cluster token (default COLLECTIVE_TOKEN)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens each greedy generation adds (default 8)")
    p.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds (default 120)")
    p.add_argument("--held", default=None, metavar="FILE", help="write each step held to FILE (the trainer's --wait-for)")
    args = p.parse_args(argv)
    if args.until_step < 0 or args.new_tokens < 1 or args.timeout <= 0:
        raise UsageError("--until-step must be >= 0, --new-tokens >= 1, --timeout > 0")
    return args


def held(path: str | None, step: int) -> None:
    if path:
        with open(path + ".tmp", "w") as fh:
            fh.write(str(step))
        os.replace(path + ".tmp", path)


def generate(model: torch.nn.Module, new_tokens: int) -> list[list[int]]:
    prompts = torch.tensor(PROMPTS)
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             do_sample=False)
    return out[:, prompts.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = build(seed=12345).eval().requires_grad_(False)  # other weights than the trainer's, until the fetch
    started = time.monotonic()
    with collective.torch.subscribe(model, args.source, token=args.token, timeout=args.timeout) as sub:
        before = weights(model)
        say(event="step", step=sub.step, manifest=sub.manifest_digest, weights=weights_digest(model),
            kind="full", apply_seconds=round(time.monotonic() - started, 4), generations=0)
        held(args.held, sub.step)
        generations, tokens = 0, None
        while sub.step < args.until_step:
            if time.monotonic() - started > args.timeout:
                print(f"inference: error: step {args.until_step} not held after {args.timeout:g} s "
                      f"(holding step {sub.step})", file=sys.stderr)
                return 1
            tokens = generate(model, args.new_tokens)
            generations += 1
            t0 = time.monotonic()
            step = sub.apply(timeout=0.02)  # a short wait: not a busy loop when no step comes
            if step is None:
                continue
            seconds = time.monotonic() - t0
            count, total = changed(before, model)
            before = weights(model)
            stats = sub.stats
            say(event="step", step=step, manifest=sub.manifest_digest, weights=weights_digest(model),
                changed_fraction=round(count / total, 6), delta_bytes=stats.get("bytes"), kind=stats.get("kind"),
                applied=stats.get("steps"),
                apply_seconds=round(seconds, 4), generations=generations, tokens=tokens)
            held(args.held, step)
            generations = 0
        say(event="done", step=sub.step, tokens=generate(model, args.new_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
