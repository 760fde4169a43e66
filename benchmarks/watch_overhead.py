"""What ``convcheck.watch`` costs (issue 25): ratios against the bare loop, in one process.

For each model: N bare SGD steps and N watched steps (statistics every step, no snapshot), alternated
round by round so that both see the same machine; then the snapshot's cost, two ways (issue 45):

* one snapshot step in a block of its own - ``with convcheck.watch(...)`` around one step, timed from the step's
  start to the block's end (its exit, which waits for the snapshot's file, included; its enter not) - against the
  fastest of the bare steps around it, once per round: what a loop that snapshots and leaves at once pays (before
  issue 45's background write this timed the step alone, the file written inside it, the exit left out);
* the snapshot inside a run: a watched block of N steps with a snapshot at step 0 against the same block without
  one (enter and exit in both, the exit's wait for the file included), alternated round by round, the difference
  in bare steps of the same round (the snapshot's remaining cost, its file written in the background while the
  later steps run), and the snapshot step as the run pays for it - that difference plus a watched step - as a
  ratio against a bare step;

and two floors beside the anchors (the naive hook, ``detect_anomaly``): every leaf's output and the gradient into
it read once (one ``sum`` each, nothing else) - the least any check of every activation and gradient costs - and a
bare step plus the snapshot's file hashed (SHA-256) and written once - the least a snapshot of that size costs; and
the process's peak RSS growth over the snapshot steps against the snapshot's size. Each ratio is the median
over the rounds, in wall time and in the process's CPU time (every thread's: the background write's included; on
a shared, loaded machine the CPU-time ratio is the steadier of the two).

    python benchmarks/watch_overhead.py --models cifar_cnn,resnet18,transformer --steps 10 --rounds 3

``transformer`` is a small one defined here (2 encoder layers, d_model 128, 4 heads, 64 positions of 32
features, mean-pooled to 10 classes); ``char_gru`` a character-level language model (an ``nn.GRUCell`` of width
128 and its output ``nn.Linear`` called once per character in a Python loop over 64 characters, a vocabulary of
96: 128 small module calls a step, where a hook's per-call cost shows); the others are the zoo's. Each ratio is
printed with its spread over the rounds (lowest-highest). ``--device cuda`` runs the same on a GPU (each
timed loop ends with a synchronize).

``--compile BACKEND`` (inductor, aot_eager, eager): the model is ``torch.compile(model, backend=BACKEND)``d
once, and the bare and watched loops both call the compiled module (the watch is handed the compiled
module, as a user writes it): the ratio is a watched compiled step against a bare compiled step.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import types
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import convcheck  # noqa: E402
from reference_models import get_spec  # noqa: E402


def _sync(batches) -> None:
    if batches and batches[0][0].is_cuda:
        torch.cuda.synchronize()


def _steps(model, opt, batches, w=None) -> tuple[float, float]:
    """``model``: what the loop calls (the compiled module under ``--compile``)."""
    _sync(batches)
    t0, c0 = time.perf_counter(), time.process_time()
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if w is not None:
            w.step(loss)
    _sync(batches)
    return time.perf_counter() - t0, time.process_time() - c0


class TinyTransformer(nn.Module):
    """A small Transformer classifier: 64 positions of 32 features, 2 encoder layers of width 128, 4 heads."""

    def __init__(self, features: int = 32, d: int = 128, heads: int = 4, layers: int = 2, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=True), layers,
            enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.norm(self.encoder(self.embed(x))).mean(1))


class CharGRU(nn.Module):
    """A character-level language model as a tutorial writes it: the cell called once per character."""

    def __init__(self, vocab: int = 96, d: int = 128):
        super().__init__()
        self.embed, self.cell, self.head = nn.Embedding(vocab, d), nn.GRUCell(d, d), nn.Linear(d, vocab)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.cell.hidden_size, dtype=torch.float32)
        e, logits = self.embed(x), []
        for t in range(x.shape[1]):
            h = self.cell(e[:, t], h)
            logits.append(self.head(h))
        return torch.stack(logits, 1).flatten(0, 1)  # (batch x characters, vocab): the next character's scores


def _spec(name: str):
    if name == "transformer":
        return types.SimpleNamespace(factory=TinyTransformer, input_shape=(64, 32), num_classes=10)
    if name == "char_gru":  # 64 characters in, the next character at each as the target
        return types.SimpleNamespace(factory=CharGRU, batch=lambda n, device: (
            torch.randint(0, 96, (n, 64), device=device), torch.randint(0, 96, (n * 64,), device=device)))
    return get_spec(name)


class _NaiveHook:
    """The anchor the issue measures beside the watch: a forward hook on every leaf computing max |x|, mean and
    std, each read at once (what a user writes in ten lines)."""

    def __init__(self, model):
        self.handles = [m.register_forward_hook(self.hook) for m in model.modules() if not list(m.children())]
        self.rows = []

    def hook(self, module, args, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            x = output.detach()
            self.rows.append((x.abs().max().item(), x.mean().item(), x.std().item()))

    def close(self):
        for h in self.handles:
            h.remove()


class _ReadOnce:
    """The floor of any check of every activation and gradient (issue 45's 1.10x bound held against it): a forward
    hook on every leaf reading its output once (one ``sum``, nothing read back) and a pre-hook on the output's
    autograd node reading the gradient that comes into it once - no statistic, no record, no Python beyond the
    hooks'."""

    def __init__(self, model):
        self.handles = [m.register_forward_hook(self.hook) for m in model.modules() if not list(m.children())]
        self.sums = []

    def hook(self, module, args, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            self.sums.append(output.detach().sum())
            if output.grad_fn is not None:
                output.grad_fn.register_prehook(self.grad)

    def grad(self, grads):
        if grads and grads[0] is not None:
            self.sums.append(grads[0].sum())

    def close(self):
        for h in self.handles:
            h.remove()


def _write_once(data: bytes, path: Path) -> float:
    """Seconds to hash ``data`` (SHA-256, as every snapshot file is) and write it to a new file once: the floor of a
    snapshot of that size, whatever writes it."""
    t0 = time.perf_counter()
    digest = hashlib.sha256(data)
    with open(path, "wb") as f:
        f.write(data)
    digest.hexdigest()
    took = time.perf_counter() - t0
    path.unlink()
    return took


def _block(model, opt, batches, out, snapshot_steps) -> tuple[float, float]:
    """A whole watched block over ``batches``: its enter, the steps and its exit (which waits for a snapshot's file)."""
    _sync(batches)
    t0, c0 = time.perf_counter(), time.process_time()
    with convcheck.watch(model, opt, out=out, snapshot_steps=snapshot_steps) as w:
        _steps(model, opt, batches, w)
    _sync(batches)
    return time.perf_counter() - t0, time.process_time() - c0


def _in_run(triples, steps: int, i: int) -> tuple[list[float], list[float]]:
    """Per round, from (with a snapshot, without, bare) timings (``i``: 0 wall, 1 CPU): what the snapshot added to the
    run in bare steps, and the snapshot step as the run pays for it (that plus a watched step) against a bare step."""
    extra, step = [], []
    for snap, plain, bare in triples:
        one = bare[i] / steps
        extra.append((snap[i] - plain[i]) / one)
        step.append((snap[i] - plain[i] + plain[i] / steps) / one)
    return extra, step


def _anchors(model, opt, batches) -> dict:
    """One round of each anchor over the same batches: the naive hook, and ``torch.autograd.detect_anomaly``."""
    naive = _NaiveHook(getattr(model, "_orig_mod", model))
    try:
        t_naive = _steps(model, opt, batches)
    finally:
        naive.close()
    with torch.autograd.detect_anomaly(check_nan=True):
        t_anomaly = _steps(model, opt, batches)
    once = _ReadOnce(getattr(model, "_orig_mod", model))
    try:
        t_once = _steps(model, opt, batches)
    finally:
        once.close()
    return {"naive": t_naive, "anomaly": t_anomaly, "read_once": t_once}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _ratios(pairs) -> tuple[float, float]:
    """Median of the rounds' watched/bare ratios, in wall time and in CPU time."""
    return (statistics.median(w[0] / b[0] for w, b in pairs), statistics.median(w[1] / b[1] for w, b in pairs))


def _spread(pairs) -> list[float]:
    """The lowest and highest of the rounds' wall-time ratios."""
    r = [w[0] / b[0] for w, b in pairs]
    return [min(r), max(r)] if r else []


def measure(name: str, steps: int, rounds: int, batch: int, backend: str | None = None, device: str = "cpu") -> dict:
    spec = _spec(name)
    torch.manual_seed(0)
    model = spec.factory().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if backend is not None:
        model = torch.compile(model, backend=backend)
    make = getattr(spec, "batch", None) or (lambda n, device: (
        torch.randn(n, *spec.input_shape, device=device), torch.randint(0, spec.num_classes, (n,), device=device)))
    batches = [make(batch, device) for _ in range(steps)]
    _steps(model, opt, batches[:2])  # warm up
    stats_pairs, snap_pairs, naive_pairs, anomaly_pairs, once_pairs = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            bare = _steps(model, opt, batches)
            with convcheck.watch(model, opt, out=Path(tmp) / f"w{r}", snapshot_steps=()) as w:
                stats_pairs.append((_steps(model, opt, batches, w), bare))
            if backend is None:  # the anchors, in the same round (eager only: detect_anomaly does not compile)
                got = _anchors(model, opt, batches)
                naive_pairs.append((got["naive"], bare))
                anomaly_pairs.append((got["anomaly"], bare))
                once_pairs.append((got["read_once"], bare))
        rss0 = _rss_mb()
        for r in range(rounds):
            before = _steps(model, opt, batches[:1])
            with convcheck.watch(model, opt, out=Path(tmp) / f"snap{r}", snapshot_steps=(0,)) as w:
                _sync(batches)
                t0, c0 = time.perf_counter(), time.process_time()  # the step and the block's exit, not its enter
                _steps(model, opt, batches[:1], w)
            _sync(batches)
            one_snap = (time.perf_counter() - t0, time.process_time() - c0)
            after = _steps(model, opt, batches[:1])
            snap_pairs.append((one_snap, (min(before[0], after[0]), min(before[1], after[1]))))
        snap_mb = sum(p.stat().st_size for p in (Path(tmp) / "snap0" / "snapshots").iterdir()
                      if p.name.startswith("step_")) / 1e6
        rss_growth = _rss_mb() - rss0
        snap_file = next(p for p in (Path(tmp) / "snap0" / "snapshots").iterdir() if p.name.startswith("step_"))
        data = snap_file.read_bytes()
        write_once = []  # per round: a bare step plus hashing and writing the snapshot's bytes once, in bare steps
        for r in range(rounds):
            bare = _steps(model, opt, batches[:1])[0]
            write_once.append((bare + _write_once(data, Path(tmp) / "once.bin")) / bare)
        del data
        run_triples = []  # (a watched run with a snapshot at step 0, the same without, a bare run), per round
        for r in range(rounds):
            bare = _steps(model, opt, batches)
            got = {}
            for snap in ((True, False) if r % 2 == 0 else (False, True)):  # alternated: neither always first
                got[snap] = _block(model, opt, batches, Path(tmp) / f"run{r}{'s' if snap else ''}",
                                   (0,) if snap else ())
            run_triples.append((got[True], got[False], bare))
    stats_wall, stats_cpu = _ratios(stats_pairs)
    snap_wall, snap_cpu = _ratios(snap_pairs)
    extra_wall, step_wall = _in_run(run_triples, steps, 0)
    extra_cpu, step_cpu = _in_run(run_triples, steps, 1)
    in_run = {"in_run_steps": steps, "in_run_extra_bare_steps": statistics.median(extra_wall),
              "in_run_extra_bare_steps_cpu": statistics.median(extra_cpu),
              "in_run_snapshot_ratio": statistics.median(step_wall),
              "in_run_snapshot_cpu_ratio": statistics.median(step_cpu),
              "in_run_snapshot_spread": [min(step_wall), max(step_wall)]}
    arms = (("naive", naive_pairs), ("anomaly", anomaly_pairs), ("read_once", once_pairs))
    anchors = {f"{k}_ratio": _ratios(v)[0] for k, v in arms if v}
    # the watch against the naive hook round by round (both against the same bare loop)
    anchors.update({f"{k}_spread": _spread(v) for k, v in arms if v})
    anchors["write_once_ratio"] = statistics.median(write_once)
    if naive_pairs:
        anchors["watch_over_naive"] = statistics.median(s[0][0] / n[0][0] for s, n in zip(stats_pairs, naive_pairs))
    return {**anchors, **in_run, "model": name, "stats_ratio": stats_wall, "stats_cpu_ratio": stats_cpu,
            "stats_spread": _spread(stats_pairs), "snapshot_spread": _spread(snap_pairs), "rounds": rounds,
            "snapshot_ratio": snap_wall,
            "snapshot_cpu_ratio": snap_cpu, "snapshot_mb": snap_mb, "rss_growth_mb": rss_growth}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="cifar_cnn,resnet18")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--compile", default=None, metavar="BACKEND", help="torch.compile the model with this backend")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON to PATH")
    args = p.parse_args()
    results = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, device {args.device}"
          + (f", torch.compile(backend={args.compile!r})" if args.compile else ", eager"))
    for name in args.models.split(","):
        r = measure(name, args.steps, args.rounds, args.batch, args.compile, args.device)
        results.append(r)
        sp = "({:.2f}-{:.2f})".format
        print(f"{r['model']:<10} statistics every step: {r['stats_ratio']:.3f}x bare {sp(*r['stats_spread'])} (CPU "
              f"time {r['stats_cpu_ratio']:.3f}x) | one snapshot step in a block of its own (the step and the exit that "
              f"waits for its file): {r['snapshot_ratio']:.2f}x a bare step {sp(*r['snapshot_spread'])} (CPU "
              f"time {r['snapshot_cpu_ratio']:.2f}x, {r['snapshot_mb']:.1f} MB) | peak RSS growth "
              f"{r['rss_growth_mb']:.1f} MB")
        print(f"{'':<10} the snapshot inside a run of {r['in_run_steps']} watched steps (with/without alternated, "
              f"enter and exit with its wait included): it adds {r['in_run_extra_bare_steps']:.2f} bare steps (CPU "
              f"time {r['in_run_extra_bare_steps_cpu']:.2f}); the snapshot step as the run pays for it "
              f"{r['in_run_snapshot_ratio']:.2f}x a bare step {sp(*r['in_run_snapshot_spread'])} (CPU time "
              f"{r['in_run_snapshot_cpu_ratio']:.2f}x)")
        if "naive_ratio" in r:
            print(f"{'':<10} anchors in the same rounds: a naive max|x|/mean/std hook {r['naive_ratio']:.3f}x bare "
                  f"{sp(*r['naive_spread'])}, torch.autograd.detect_anomaly {r['anomaly_ratio']:.3f}x bare "
                  f"{sp(*r['anomaly_spread'])}; the watch {r['watch_over_naive']:.3f}x the naive hook")
            print(f"{'':<10} floors: every leaf's output and the gradient into it read once (one sum each) "
                  f"{r['read_once_ratio']:.3f}x bare {sp(*r['read_once_spread'])}; a bare step plus the snapshot's "
                  f"{r['snapshot_mb']:.1f} MB hashed and written once {r['write_once_ratio']:.2f}x a bare step")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps({
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "device": args.device, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
            "compile": args.compile, "load_average_end": os.getloadavg()[0], "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
