"""The trainer of the every-step example: trains a tiny Qwen2 in bf16 with AdamW and publishes
its weights after every step (only the changed elements cross; followers verify each step).

    python examples/rl_loop/trainer.py --steps 5 --bind 127.0.0.1:0 --token secret
    python examples/rl_loop/inference.py --source ADDRESS --until-step 5 --token secret

Prints one JSON line per event: ``{"event": "publishing", "address": ...}`` once step 0 (the
initial weights, seed ``--seed``) is served, then per step ``{"event": "step", "step", "manifest",
"weights", "changed_fraction", "delta_bytes", "update_seconds", "served_seconds", "loss"}``:
the publication's manifest digest of the step, the digest of the weights this process's own
tensors hold (``model.weights_digest``), the fraction of bf16 elements whose bits the step
changed, the bytes of the step's delta as served (``Publication.last_update``), the seconds
``update`` took to return (the copy) and until the step was served (the delta made). After the last step it keeps
serving for ``--linger`` seconds (a follower catches up), then closes.

``--wait-for FILE`` runs in lock step, as an on-policy RL loop does (the next step trains on
rollouts of the current weights): before step k it waits until FILE (the inference process's
``--held FILE``) says step k-1 is held, at most ``--timeout`` seconds; ``--max-lag N`` lets it
run up to N steps ahead of the inference process (once that holds step 0), as asynchronous RL
does (rollouts at most N steps stale): then the inference process may be behind when it
applies, and takes the newest.
Without ``--wait-for`` the trainer runs free, a step every ``--interval`` seconds.

The loss is next-token cross-entropy on random token batches drawn from ``--seed``: the
optimizer's steps are real AdamW steps at an RL-like learning rate (``--lr``, default 1e-6); what
the example shows is the hand-off, not learning.
"""

from __future__ import annotations

import argparse
import time

import torch
from model import CONFIG, build, changed, say, weights, weights_digest

import collective
import collective.torch
from collective.entry import run_main
from collective.errors import UsageError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps to train and publish (default 5)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate (default 1e-6)")
    p.add_argument("--seed", type=int, default=0, help="the initial weights' and the batches' seed")
    p.add_argument("--interval", type=float, default=0.0,
                   help="seconds to pause before each step (a stand-in for waiting on rollouts; default 0)")
    p.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT to publish at (default 127.0.0.1:0)")
    p.add_argument("--token", default=None, help="the cluster token (default COLLECTIVE_TOKEN)")
    p.add_argument("--linger", type=float, default=30.0, help="seconds to keep serving after the last step")
    p.add_argument("--wait-for", default=None, metavar="FILE",
                   help="lock step: before step k, wait until FILE holds k-1 (the inference's --held)")
    p.add_argument("--max-lag", type=int, default=0,
                   help="with --wait-for: run up to N steps ahead of the inference process (default 0)")
    p.add_argument("--timeout", type=float, default=120.0, help="--wait-for's bound, in seconds (default 120)")
    args = p.parse_args(argv)
    if (args.steps < 1 or not 0 < args.lr < 1 or min(args.interval, args.linger, args.max_lag) < 0
            or args.timeout <= 0):
        raise UsageError("--steps must be >= 1, --lr in (0, 1), --interval, --linger and --max-lag >= 0, "
                         "--timeout > 0")
    return args


def wait_for(path: str, step: int, timeout: float) -> None:
    """Wait until the file at ``path`` holds a step >= ``step`` (the inference process writes it
    whole, by rename); UsageError naming it after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as fh:
                if int(fh.read() or -1) >= step:
                    return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise UsageError(f"--wait-for {path}: step {step} not held after {timeout:g} s")
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = build(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = torch.Generator().manual_seed(args.seed + 1)
    pub = collective.torch.publish_module(model, step=0, token=args.token, bind=args.bind, name="trainer")
    with pub:
        say(event="publishing", address=pub.address, step=0, manifest=pub.manifest_digest,
            weights=weights_digest(model))
        for step in range(1, args.steps + 1):
            if args.wait_for:
                wait_for(args.wait_for, max(step - 1 - args.max_lag, 0), args.timeout)  # step 0 held first
            time.sleep(args.interval)
            before = weights(model)
            tokens = torch.randint(0, CONFIG["vocab_size"], (4, 32), generator=batches)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            started = time.monotonic()
            pub.update(collective.torch.module_state(model), step=step)
            returned = time.monotonic()
            pub.wait()
            served = time.monotonic()
            count, total = changed(before, model)
            say(event="step", step=step, manifest=pub.manifest_digest, weights=weights_digest(model),
                changed_fraction=round(count / total, 6), delta_bytes=pub.last_update["delta_bytes"],
                state_bytes=sum(a.nbytes for a in before.values()), update_seconds=round(returned - started, 4),
                served_seconds=round(served - started, 4), loss=round(loss.item(), 4))
        say(event="done", step=args.steps)
        time.sleep(args.linger)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
