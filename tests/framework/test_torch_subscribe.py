"""collective.torch's every-step hand-off over real publish / subscribe (loopback gRPC, in one
process): a trainer's module published each step, a follower's module updated in place by
``apply()``: the same Parameter objects, the same memory, the publisher's bits (bf16 included)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.clusters import TOKEN
from tests.framework.conftest import require

torch = require("torch")

from collective.digest import array_digest  # noqa: E402
from collective.errors import UsageError  # noqa: E402
from collective.torch import module_state, publish_module, receive_targets, subscribe, to_numpy  # noqa: E402


class Tied(torch.nn.Module):
    """A language model's shape in miniature: an embedding tied to the output layer, a norm, a
    float32 buffer beside bf16 parameters."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(64, 16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight
        self.to(torch.bfloat16)
        self.register_buffer("scale", torch.rand(16, generator=torch.Generator().manual_seed(seed)))

    def forward(self, ids):
        return self.head(self.norm(self.mlp(self.embed(ids)) * self.scale.to(torch.bfloat16)))


def digests(module: torch.nn.Module) -> dict[str, str]:
    """Each state tensor's digest, read from the module's own tensors."""
    return {name: array_digest(to_numpy(t)) for name, t in module.state_dict().items()}


def train_step(model: torch.nn.Module, optimizer, seed: int) -> None:
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(seed))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), ids.reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.scale.mul_(1.001)  # a buffer changes too


def identities(module: torch.nn.Module) -> list[tuple[str, int, int]]:
    return [(name, id(t), t.data_ptr()) for name, t in module.state_dict(keep_vars=True).items()]


def apply_until(sub, step: int) -> None:
    while sub.step < step:
        assert sub.apply(timeout=60) is not None, f"step {step} did not arrive within 60 s (holding {sub.step})"


def test_module_state_is_views_of_the_tensors_with_a_tied_tensor_once():
    m = Tied(0)
    state = module_state(m)
    assert "head.weight" not in state and "embed.weight" in state  # the tied tensor, once
    assert set(state) == set(m.state_dict()) - {"head.weight"}
    assert state["embed.weight"].ctypes.data == m.embed.weight.data_ptr()  # a view, not a copy
    assert state["embed.weight"].dtype.name == "bfloat16" and state["scale"].dtype == np.float32
    with_optimizer = module_state(m, torch.optim.AdamW(m.parameters(), lr=1e-3))
    assert set(with_optimizer) == {"model", "optimizer"} and set(with_optimizer["model"]) == set(state)


def test_receive_targets_of_bf16_tensors_share_their_memory():
    m = Tied(0)
    targets = receive_targets(m)
    targets["mlp.0.weight"][0, 0] = np.asarray(3.0, targets["mlp.0.weight"].dtype)
    assert float(m.mlp[0].weight.detach()[0, 0]) == 3.0


def test_publish_module_refuses_a_publication_update_cannot_follow():
    with pytest.raises(UsageError, match="copy=True"):
        publish_module(Tied(0), step=0, copy=False, token=TOKEN, bind="127.0.0.1:0")


def test_each_applied_step_is_the_publishers_bits_in_the_same_parameters():
    trainer, follower = Tied(0), Tied(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    with publish_module(trainer, step=0, token=TOKEN, bind="127.0.0.1:0") as pub:
        before = identities(follower)
        with subscribe(follower, pub.address, token=TOKEN, timeout=60) as sub:
            assert sub.step == 0 and sub.manifest_digest == pub.manifest_digest
            assert digests(follower) == digests(trainer)
            for step in (1, 2, 3):
                train_step(trainer, optimizer, step)
                pub.update(module_state(trainer), step=step)
                pub.wait()
                assert digests(follower) != digests(trainer)  # nothing lands before apply()
                apply_until(sub, step)
                assert sub.step == step and sub.manifest_digest == pub.manifest_digest
                assert identities(follower) == before  # the same objects, the same memory
                assert digests(follower) == digests(trainer)
                assert follower.head.weight is follower.embed.weight
            ids = torch.arange(12).reshape(1, 12)
            assert torch.equal(follower(ids), trainer(ids))


def test_an_optimizer_follows_too_and_trains_on_as_the_trainer_does():
    trainer, follower = Tied(0), Tied(1)
    ours, theirs = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (trainer, follower))
    train_step(trainer, ours, 0)  # the trainer's optimizer has state; the follower's none yet
    with publish_module(trainer, step=0, optimizer=ours, token=TOKEN, bind="127.0.0.1:0") as pub:
        with subscribe(follower, pub.address, optimizer=theirs, token=TOKEN, timeout=60) as sub:
            for step in (1, 2):
                ours.param_groups[0]["lr"] = 1e-3 / (step + 1)  # a schedule: the hyper-parameters travel
                train_step(trainer, ours, step)
                pub.update(module_state(trainer, ours), step=step)
                pub.wait()
                apply_until(sub, step)
                assert digests(follower) == digests(trainer)
                assert theirs.param_groups[0]["lr"] == ours.param_groups[0]["lr"]
                mine, its = ours.state_dict()["state"], theirs.state_dict()["state"]
                assert {k: {n: array_digest(to_numpy(t)) for n, t in v.items()} for k, v in its.items()} == \
                    {k: {n: array_digest(to_numpy(t)) for n, t in v.items()} for k, v in mine.items()}
    # A replica that took the state trains on to the trainer's very bits.
    train_step(trainer, ours, 9)
    train_step(follower, theirs, 9)
    assert digests(follower) == digests(trainer)


def test_a_publication_of_another_module_is_refused_in_one_line():
    bigger = Tied(0)
    with publish_module(bigger, step=0, token=TOKEN, bind="127.0.0.1:0") as pub:
        smaller = torch.nn.Sequential()
        smaller.norm = torch.nn.LayerNorm(16).to(torch.bfloat16)
        with pytest.raises(UsageError, match=r"6 tensor\(s\) the module has not: embed\.weight, mlp\.0\.bias") as err:
            subscribe(smaller, pub.address, token=TOKEN, timeout=60)
        assert "\n" not in str(err.value)
        other = Tied(0).to(torch.float32)  # the same names, another dtype
        with pytest.raises(UsageError, match="bfloat16"):
            subscribe(other, pub.address, token=TOKEN, timeout=60)


def test_auto_is_refused_where_apply_has_more_to_load_than_the_arrays():
    m = Tied(0)
    with pytest.raises(UsageError, match="auto=True .* call apply"):
        subscribe(m, "127.0.0.1:1", optimizer=torch.optim.AdamW(m.parameters()), auto=True, token=TOKEN)


def test_a_tensor_the_arrays_cannot_view_is_copied_into_after_each_step_and_checked():
    """A non-contiguous buffer (as a device tensor would be) is not an ``into`` array: apply()
    copies the verified step into it, in place, and reads it back."""

    def module(seed: int) -> torch.nn.Module:
        m = Tied(seed)
        m.register_buffer("strided", torch.randn(5, 7, generator=torch.Generator().manual_seed(seed)).t())
        return m

    trainer, follower = module(0), module(1)
    strided = follower.strided
    assert not strided.is_contiguous()
    with publish_module(trainer, step=0, token=TOKEN, bind="127.0.0.1:0") as pub:
        with subscribe(follower, pub.address, token=TOKEN, timeout=60) as sub:
            assert digests(follower) == digests(trainer)
            trainer.strided.add_(1.0)
            pub.update(module_state(trainer), step=1, wait=True)
            apply_until(sub, 1)
            assert follower.strided is strided and not strided.is_contiguous()
            assert digests(follower) == digests(trainer)
