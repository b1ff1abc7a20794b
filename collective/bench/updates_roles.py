"""The processes of ``collective bench updates``: one publisher and N subscribers per row.

``python -m collective.bench.updates_roles ROLE --dir ROWDIR`` (the row's settings are in
``ROWDIR/row.json``, written by ``collective.bench.updates``). Every role prints ``result {json}``
at the end. The processes meet through files in ROWDIR (a shared filesystem on one host and on
emulated hosts alike; only ``/dev/shm`` is private to an emulated host):

* ``addr``: what the subscribers dial (written by the publisher once it serves step 0);
* ``ready-I-K``: subscriber I holds step K, verified (K = 0: subscribed and ready);
* ``expect-K``: step K's state digest, written by the publisher before step K's clock starts
  (what a subscriber checks what it holds against, and what the bench checks after the run);
* ``go`` (from the bench, after it read the publisher's link counters): start the steps;
  ``finish`` (from the bench, after it read them again): exit.

Monotonic clock readings cross processes (one machine, one CLOCK_MONOTONIC, namespaces or not):
a step's seconds are the last subscriber's ``held`` minus the publisher's ``t0`` (its send call
returning: ``update``) or ``call`` (the call starting: the copy ``update`` makes counts too).

Roles (KIND in row.json): ``delta`` (``collective.publish`` + ``pub.update`` ->
``collective.subscribe`` + ``sub.apply``), ``fetch`` (``pub.update`` -> ``collective.fetch`` of
the whole step once it is served), ``gloo`` (``torch.distributed.broadcast`` of the whole state, rank 0 the
publisher), ``file`` (a sparse safetensors delta file as TRL writes it: indices and values of
every changed tensor, ``safetensors.torch.save_file``; each subscriber downloads it from the
publisher over HTTP, ``load_file``, applies and verifies). ``fraction`` measures the share of
bf16 elements AdamW changes per step in a small transformer.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import resource
import socket
import struct
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

TOKEN = "bench-updates-token"
LIFETIME = 1800.0  # every wait ends after this long (the bench kills its processes by pid too)
POLL = 0.001


# --- the state and its steps -------------------------------------------------------------------


def tensor_names(cfg: dict) -> list[str]:
    return [f"layers.{i}.weight" for i in range(cfg["tensors"])]


def make_state(cfg: dict) -> dict[str, np.ndarray]:
    """``cfg["bytes"]`` of bf16 in ``cfg["tensors"]`` tensors, seeded (every process can rebuild
    step 0): normal values of std 0.02, as a transformer's initializer draws them."""
    import ml_dtypes

    per = cfg["bytes"] // cfg["tensors"] // 2
    rng = np.random.default_rng(cfg["seed"])
    out = {}
    for name in tensor_names(cfg):
        a = np.empty(per, dtype=ml_dtypes.bfloat16)
        for s in range(0, per, 1 << 22):
            e = min(per, s + (1 << 22))
            a[s:e] = (rng.standard_normal(e - s, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        out[name] = a
    return out


def empty_state(cfg: dict) -> dict[str, np.ndarray]:
    import ml_dtypes

    per = cfg["bytes"] // cfg["tensors"] // 2
    return {name: np.zeros(per, dtype=ml_dtypes.bfloat16) for name in tensor_names(cfg)}


def step_state(state: dict[str, np.ndarray], cfg: dict, step: int) -> int:
    """Change ``cfg["fraction"]`` of every tensor's elements, at uniformly random positions (the
    positions drawn with replacement, so a few fewer), each to another bit pattern. Returns the
    number of elements changed."""
    rng = np.random.default_rng([cfg["seed"], step])
    changed = 0
    for a in state.values():
        bits = a.view(np.int16)
        pos = np.unique(rng.integers(0, bits.size, int(round(bits.size * cfg["fraction"]))))
        # The low 7 bits are the mantissa's: a new value of about the same size, never the same.
        bits[pos] ^= rng.integers(1, 1 << 7, pos.size, dtype=np.int16)
        changed += pos.size
    return changed


def state_digest(state: dict[str, np.ndarray]) -> str:
    from collective.digest import array_digest, combined_digest

    return combined_digest((name, array_digest(state[name])) for name in sorted(state))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- meeting through files ------------------------------------------------------------------------


def wait_file(path: Path, what: str) -> str:
    """Block until ``path`` exists (every writer renames it into place whole); its text."""
    deadline = time.monotonic() + LIFETIME
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} ({path.name}) after {LIFETIME:g} s")
        time.sleep(POLL)
    return "" if path.suffix == ".safetensors" else path.read_text()


def put(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_all_ready(d: Path, cfg: dict, step: int) -> None:
    for i in range(cfg["subscribers"]):
        wait_file(d / f"ready-{i}-{step}", f"subscriber {i} at step {step}")


def result(**fields) -> None:
    print("result " + json.dumps(fields), flush=True)


def tcp_bytes_acked() -> dict[str, int]:
    """This process's TCP sockets by inode: the bytes each has sent and had acknowledged
    (``tcp_info.tcpi_bytes_acked``). Per socket, so a step's count survives sockets that come
    and go: ``sent_between(before, after)``."""
    out: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not link.startswith("socket:") or link in out:
            continue
        try:
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:  # not a TCP socket
            continue
        if len(info) >= 128:
            out[link] = struct.unpack_from("<Q", info, 120)[0]  # tcpi_bytes_acked
    return out


def sent_between(before: dict[str, int], after: dict[str, int]) -> int:
    return sum(n - before.get(k, 0) for k, n in after.items())


# --- publishers ----------------------------------------------------------------------------------


class _Steps:
    """The publisher's loop, common to every kind: rebuild step 0, serve it, wait for every
    subscriber, then per step change the state, write the digest, send (``send(step)`` returns
    (call, t0, delta-making seconds or None)), wait for every subscriber, count the bytes."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self.cfg = json.loads((d / "row.json").read_text())
        self.state = make_state(self.cfg)
        put(d / "expect-0", state_digest(self.state))

    def run(self, send, count) -> None:
        d, cfg = self.d, self.cfg
        wait_all_ready(d, cfg, 0)
        print("begin", flush=True)
        wait_file(d / "go", "go")
        calls, t0s, makes, sent, changed = [], [], [], [], []
        for step in range(1, cfg["steps"] + 1):
            changed.append(step_state(self.state, cfg, step))
            put(d / f"expect-{step}", state_digest(self.state))
            before = count()
            call, t0, make = send(step)
            calls.append(call)
            wait_all_ready(d, cfg, step)
            sent.append(count() - before)
            t0s.append(t0)
            makes.append(make)
        print("end", flush=True)
        wait_file(d / "finish", "finish")
        result(call=calls, t0=t0s, make=makes, bytes=sent, changed=changed, peak_rss_mib=peak_rss_mib())


def publisher_delta(d: Path, announce: bool = False) -> None:
    """``pub.update`` per step. ``announce``: the fetch row's publisher, whose subscribers
    ``fetch`` each step in full once it is served (``step-K``); the update serves it both ways."""
    import collective

    steps = _Steps(d)
    pub = collective.publish(steps.state, step=0, copy=True, token=TOKEN, bind=f"{steps.cfg['host']}:0")
    put(d / "addr", pub.address)

    def send(step: int):
        call = time.monotonic()
        pub.update(steps.state, step=step)
        t0 = time.monotonic()
        pub.wait()
        if announce:
            put(d / f"step-{step}", "")
        # The delta's own making (the diff of every tensor against the baseline copy, coded).
        return call, t0, pub.last_update["delta_seconds"]

    steps.run(send, lambda: pub.stats()["bytes_served"])
    pub.close()


def publisher_fetch(d: Path) -> None:
    publisher_delta(d, announce=True)


class _Counted(http.server.SimpleHTTPRequestHandler):
    sent = 0
    lock = threading.Lock()

    def copyfile(self, source, outputfile) -> None:
        data = source.read()
        with _Counted.lock:  # counted before it is sent: the reader may say it holds the step at once
            _Counted.sent += len(data)
        outputfile.write(data)

    def log_message(self, *args) -> None:
        pass


def publisher_file(d: Path) -> None:
    import torch
    from safetensors.torch import save_file

    steps = _Steps(d)
    prev = {name: a.view(np.int16).copy() for name, a in steps.state.items()}  # the baseline copy
    served = d / "served"
    served.mkdir()
    handler = lambda *a, **k: _Counted(*a, directory=str(served), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer((steps.cfg["host"], 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    put(d / "addr", f"{steps.cfg['host']}:{server.server_address[1]}")

    def send(step: int):
        t0 = time.monotonic()
        tensors = {}
        for name, a in steps.state.items():
            cur, old = a.view(np.int16), prev[name]
            idx = np.flatnonzero(cur != old)
            if idx.size:
                values = cur[idx]
                old[idx] = values
                tensors[f"{name}.indices"] = torch.from_numpy(idx.astype(np.int32))
                tensors[f"{name}.values"] = torch.from_numpy(values).view(torch.bfloat16)
        path = served / f"delta-{step}.safetensors"
        save_file(tensors, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        return t0, t0, time.monotonic() - t0

    steps.run(send, lambda: _Counted.sent)
    server.shutdown()


# --- subscribers -----------------------------------------------------------------------------------


class _Held:
    """A subscriber's record: per step the monotonic time it held the verified step, its
    apply(+verify) seconds, and whether the state then matched the publisher's digest."""

    def __init__(self, d: Path, index: int) -> None:
        self.d, self.index = d, index
        self.cfg = json.loads((d / "row.json").read_text())
        self.held: list[float] = []
        self.apply: list[float] = []
        self.verified: list[bool] = []

    def ready(self, step: int, state: dict[str, np.ndarray], held: float | None = None,
              apply: float | None = None, checked: bool = True) -> None:
        """Outside the clock: compare the whole state with the publisher's digest of the step."""
        ok = checked and state_digest(state) == (self.d / f"expect-{step}").read_text()
        if step:
            self.held.append(held)
            self.apply.append(apply)
            self.verified.append(ok)
        elif not ok:
            raise RuntimeError(f"subscriber {self.index}: step 0 differs from the publisher's")
        put(self.d / f"ready-{self.index}-{step}", "")

    def done(self) -> None:
        result(held=self.held, apply=self.apply, verified=self.verified, peak_rss_mib=peak_rss_mib())


def subscriber_delta(d: Path, index: int) -> None:
    """``apply()`` once a step is waiting (``tree`` in row.json: subscribers in a binary tree,
    each serving what it applied to its two children, ``auto=True``, the publisher every one's
    spare). shm=False: the stream another host gets, not a same-host mapping."""
    import collective

    h = _Held(d, index)
    addr = wait_file(d / "addr", "address")
    arrays = empty_state(h.cfg)
    kw: dict = {"token": TOKEN, "into": arrays, "timeout": LIFETIME, "shm": False}
    sources = [addr]
    if h.cfg.get("tree"):
        kw.update(auto=True, stripe=False, serve=True, bind=f"{h.cfg['sub_hosts'][index]}:0", name=f"sub-{index}")
        if index:
            sources = [wait_file(d / f"saddr-{(index - 1) // 2}", "the parent's address"), addr]
    sub = collective.subscribe(sources, **kw)
    if sub.address:
        put(d / f"saddr-{index}", sub.address)
    h.ready(0, arrays)
    for step in range(1, h.cfg["steps"] + 1):
        if h.cfg.get("tree"):
            while sub.step < step or (sub.stats or {}).get("step", -1) < step:  # stats: set just after step
                time.sleep(POLL)
        else:
            while (sub.poll(timeout=1.0) or 0) < step:
                pass
            sub.apply()
        held = time.monotonic()
        st = sub.stats
        h.ready(step, arrays, held, st["apply_seconds"], checked=sub.step == step and st["kind"] == "delta")
    h.done()
    sub.close()


def subscriber_fetch(d: Path, index: int) -> None:
    import collective

    h = _Held(d, index)
    addr = wait_file(d / "addr", "address")
    arrays = empty_state(h.cfg)
    # shm=False: the stream a subscriber on another host gets, not the same-host mapping.
    collective.fetch(addr, step=0, token=TOKEN, into=arrays, timeout=LIFETIME, shm=False)
    h.ready(0, arrays)
    for step in range(1, h.cfg["steps"] + 1):
        wait_file(d / f"step-{step}", f"step {step}")
        a0 = time.monotonic()
        got = collective.fetch(addr, step=step, token=TOKEN, into=arrays, timeout=LIFETIME, shm=False)
        held = time.monotonic()
        h.ready(step, arrays, held, held - a0, checked=got.step == step)
    h.done()


def subscriber_file(d: Path, index: int) -> None:
    import torch
    from safetensors.torch import load_file

    h = _Held(d, index)
    addr = wait_file(d / "addr", "address")
    arrays = make_state(h.cfg)  # step 0: both sides start from the same weights
    flat = {name: torch.from_numpy(a.view(np.int16)) for name, a in arrays.items()}
    h.ready(0, arrays)
    mine = d / f"sub-{index}"
    mine.mkdir()
    for step in range(1, h.cfg["steps"] + 1):
        name = f"delta-{step}.safetensors"
        wait_file(d / "served" / name, f"step {step}'s delta file")
        local = mine / name
        with urllib.request.urlopen(f"http://{addr}/{name}", timeout=LIFETIME) as r, open(local, "wb") as f:
            f.write(r.read())
        a0 = time.monotonic()
        delta = load_file(str(local))
        for key, idx in delta.items():
            if key.endswith(".indices"):
                tensor = key[: -len(".indices")]
                flat[tensor][idx.long()] = delta[f"{tensor}.values"].view(torch.int16)
        expect = (d / f"expect-{step}").read_text()
        checked = state_digest(arrays) == expect  # the receiver's own check: a full pass
        held = time.monotonic()
        h.ready(step, arrays, held, held - a0, checked=checked)
    h.done()


# --- gloo: every rank one process --------------------------------------------------------------------


def gloo_rank(d: Path, rank: int) -> None:
    import torch
    import torch.distributed as dist

    cfg = json.loads((d / "row.json").read_text())
    world = cfg["subscribers"] + 1
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['gloo']}", rank=rank, world_size=world)
    per = cfg["bytes"] // cfg["tensors"] // 2
    buf = torch.empty(2 * per * cfg["tensors"], dtype=torch.uint8)  # gloo has no int16
    import ml_dtypes

    arrays = {name: buf.numpy()[2 * i * per:2 * (i + 1) * per].view(ml_dtypes.bfloat16)
              for i, name in enumerate(tensor_names(cfg))}
    if rank == 0:
        for name, a in make_state(cfg).items():
            arrays[name][:] = a
        put(d / "expect-0", state_digest(arrays))
    dist.broadcast(buf, src=0)  # step 0 (and the connections), outside the clock
    if rank:
        h = _Held(d, rank - 1)
        h.ready(0, arrays)
    dist.barrier()
    t0s, sent, changed = [], [], []  # the broadcast's call is its start: t0 is both
    if rank == 0:
        print("begin", flush=True)
        wait_file(d / "go", "go")
    for step in range(1, cfg["steps"] + 1):
        if rank == 0:
            changed.append(step_state(arrays, cfg, step))
            put(d / f"expect-{step}", state_digest(arrays))
            before = tcp_bytes_acked()
        dist.barrier()
        t0 = time.monotonic()
        dist.broadcast(buf, src=0)
        if rank:
            a0 = time.monotonic()
            checked = state_digest(arrays) == (d / f"expect-{step}").read_text()
            held = time.monotonic()
            h.ready(step, arrays, held, held - a0, checked=checked)
        dist.barrier()
        if rank == 0:
            sent.append(sent_between(before, tcp_bytes_acked()))
            t0s.append(t0)
    if rank == 0:
        print("end", flush=True)
        wait_file(d / "finish", "finish")
        result(call=t0s, t0=t0s, make=[None] * len(t0s), bytes=sent, changed=changed, peak_rss_mib=peak_rss_mib())
    else:
        h.done()
    dist.destroy_process_group()


# --- the AdamW fraction ------------------------------------------------------------------------------


def fraction(lrs: list[float], steps: int, seed: int = 0) -> None:
    """Train a small bf16 transformer with AdamW on random tokens; per lr, the share of its
    elements whose bf16 bits each step changed. transformers' Qwen2 when it is installed, else a
    stand-in of the same layout in plain torch (said in the result)."""
    import torch

    out = {}
    for lr in lrs:
        torch.manual_seed(seed)
        model, which = _small_transformer()
        model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(seed)
        per_step = []
        for _ in range(steps):
            before = [p.detach().view(torch.int16).clone() for p in model.parameters()]
            tokens = torch.randint(0, VOCAB, (8, 64), generator=gen)
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(),
                                                     tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            diff = sum(int((p.detach().view(torch.int16) != b).sum()) for p, b in zip(model.parameters(), before, strict=True))
            per_step.append(diff / sum(p.numel() for p in model.parameters()))
        out[str(lr)] = per_step
    result(model=which, parameters=sum(p.numel() for p in model.parameters()), per_step=out)


VOCAB = 4096


def _small_transformer():
    import torch

    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError:
        pass
    else:
        cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=False)
        m = Qwen2ForCausalLM(cfg)
        return _Logits(m), "transformers Qwen2ForCausalLM (hidden 128, 4 layers, vocab 4096)"

    class Block(torch.nn.Module):
        def __init__(self, h: int, f: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.n1, self.n2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
            self.q, self.k, self.v, self.o = (torch.nn.Linear(h, h, bias=b) for b in (True, True, True, False))
            self.gate, self.up = torch.nn.Linear(h, f, bias=False), torch.nn.Linear(h, f, bias=False)
            self.down = torch.nn.Linear(f, h, bias=False)

        def forward(self, x):
            b, t, h = x.shape
            y = self.n1(x)
            q, k, v = (p(y).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
            y = self.n2(x)
            return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 128)
            self.blocks = torch.nn.ModuleList(Block(128, 512, 4) for _ in range(4))
            self.norm = torch.nn.RMSNorm(128)
            self.head = torch.nn.Linear(128, VOCAB, bias=False)
            for name, p in self.named_parameters():  # Qwen2's initializer: normal(0, 0.02), biases 0
                if p.dim() > 1:
                    torch.nn.init.normal_(p, std=0.02)
                elif "norm" not in name and "n1" not in name and "n2" not in name:
                    torch.nn.init.zeros_(p)

        def forward(self, tokens):
            x = self.embed(tokens)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    return Model(), "a Qwen2-shaped stand-in in plain torch (hidden 128, 4 layers, vocab 4096; transformers not installed)"


class _Logits:
    """transformers' model called for its logits (and its parameters), as the stand-in is."""

    def __init__(self, model) -> None:
        self.model = model

    def to(self, dtype):
        self.model = self.model.to(dtype)
        return self

    def parameters(self):
        return self.model.parameters()

    def __call__(self, tokens):
        return self.model(input_ids=tokens).logits


ROLES = {"publisher-delta": publisher_delta, "publisher-fetch": publisher_fetch, "publisher-file": publisher_file,
         "subscriber-delta": subscriber_delta, "subscriber-fetch": subscriber_fetch,
         "subscriber-file": subscriber_file}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collective.bench.updates_roles")
    p.add_argument("role", choices=[*ROLES, "gloo", "fraction"])
    p.add_argument("--dir", type=Path)
    p.add_argument("--index", type=int, default=0, help="subscriber index, or gloo rank")
    p.add_argument("--lr", action="append", type=float, help="fraction: learning rates")
    p.add_argument("--steps", type=int, default=4, help="fraction: AdamW steps per lr")
    args = p.parse_args(argv)
    if args.role == "fraction":
        fraction(args.lr or [1e-5, 1e-6], args.steps)
    elif args.role == "gloo":
        gloo_rank(args.dir, args.index)
    elif args.role.startswith("publisher"):
        ROLES[args.role](args.dir)
    else:
        ROLES[args.role](args.dir, args.index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
