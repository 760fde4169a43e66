#!/usr/bin/env python
"""convcheck performance harness: every figure is a ratio against the bare model, same process.

    .venv/bin/python benchmarks/run.py [--models lenet,cifar_cnn,resnet18] [--quick]
                                       [--include-resnet50] [--profile] [--no-memory] [--repeats N]

For each model it times, in one process and on the same seeded batches:

* bare      one plain float32 forward + backward + SGD step of
            ``reference_models.get_model(name)`` (median of repeats after a
            warm-up; more bare samples are taken between the convcheck runs, so
            a machine whose load changes during the run moves both sides);
            ``bare@<target>``: the same step in a target's precision (the
            floor that target's arithmetic costs whatever convcheck does);
            ``bare x N``: N consecutive bare steps from fresh weights.
* parity    ``convcheck.measure.parity.run_parity`` for one target (``cpu``,
            ``cpu:bf16``, ``cpu:emulate-tf32``) against the float64 judge; against two floors
            (issue 28): bare@judge + bare@target, and that plus the bare float64 replays of
            the rows that need one (``Replays``: every float64 layer call parity made, recorded
            once with its operands as parity rounded them, re-run as plain torch calls).
* training  ``convcheck.measure.train.run_training`` on ``make_arms(targets, envelope=K)``
            for N steps, against N bare steps x the number of arms, and against
            N x the sum of ``bare@<arm's target>`` (the dtype-matched floor).
* compare   the whole ``convcheck.compare("lenet")`` with its defaults.
* memory    peak RSS increase over a baseline, each measurement in a fresh
            child process (peak RSS only ever grows within a process), as a
            ratio against a bare float32 forward/backward.

Results: a table on stdout, ``benchmarks/results/<date>-<host>.json`` and
``benchmarks/results/latest.md`` (both written to a temporary name and renamed; latest.md keeps
what it held below its table, from its first ``## `` heading on: the history of earlier runs).
Nothing here asserts a time: the test suite never does, this only measures.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import reference_models  # noqa: E402
from convcheck.pipeline import compare, initial_state, model_builder  # noqa: E402
from convcheck.plan.seeded_data import load_batches  # noqa: E402
from convcheck.plan.models import resolve_model  # noqa: E402
from convcheck.measure.parity import run_parity  # noqa: E402
from convcheck.measure.parity import checks as parity_checks, floor as parity_floor, own_check  # noqa: E402
from convcheck.targets.spec import Target, default_judge, default_targets  # noqa: E402
from convcheck.measure.train import TrainConfig, make_arms, run_training  # noqa: E402
from convcheck.plan.config import CompareConfig  # noqa: E402
from convcheck.plan.recipe import SGD_DEFAULT_MOMENTUM as SGD_MOMENTUM  # noqa: E402

SCHEMA = 1
SEED = 0
LR = CompareConfig().lr
MOMENTUM = SGD_MOMENTUM
JUDGE = default_judge()[0]  # the judge compare() would choose on this machine
OPTIMIZER = CompareConfig().optimizer
DEFAULT_MODELS = ("lenet", "cifar_cnn", "resnet18")
PARITY_TARGETS = ("cpu", "cpu:bf16", "cpu:emulate-tf32")

# Per model: batch size, training steps N, bare repeats, convcheck repeats, and
# whether convcheck runs get a warm-up run of their own (too dear for ResNets).
MODEL_PLAN = {
    "lenet":     dict(batch=32, steps=10, bare_repeats=7, cc_repeats=3, cc_warmup=True),
    "cifar_cnn": dict(batch=16, steps=3, bare_repeats=5, cc_repeats=2, cc_warmup=False),
    "resnet18":  dict(batch=2, steps=2, bare_repeats=3, cc_repeats=1, cc_warmup=False),
    "resnet34":  dict(batch=2, steps=1, bare_repeats=3, cc_repeats=1, cc_warmup=False),
    "resnet50":  dict(batch=2, steps=1, bare_repeats=3, cc_repeats=1, cc_warmup=False),
}
QUICK_PLAN = dict(bare_repeats=3, cc_repeats=1, cc_warmup=False)
MEMORY_PROBES = ("bare_fwd_bwd", "judge_fwd_bwd", "parity:cpu", "parity:cpu:bf16", "bare_train", "train")
QUICK_MEMORY_PROBES = ("bare_fwd_bwd", "judge_fwd_bwd", "parity:cpu")


# --------------------------------------------------------------------------- helpers

def _sync(target: Target | None = None) -> None:
    if torch.cuda.is_available() and (target is None or target.device == "cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], target: Target | None = None) -> float:
    _sync(target)
    t0 = time.perf_counter()
    fn()
    _sync(target)
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float() if out.dtype in (torch.float16, torch.bfloat16) else out, y)


def _resolved(name: str):
    return resolve_model(name)


def _batches(resolved, batch: int, n: int):
    return list(load_batches(None, input_shape=resolved.input_shape, num_classes=resolved.num_classes,
                             batch_size=batch, num_batches=n, seed=SEED).batches)


class BareModel:
    """The plain zoo model in one target's precision: no hooks, no copies, no metrics.

    The target only places the model and sets its math mode (for
    ``emulate-tf32`` that mode is the rounding itself, so it is part of the floor).
    """

    def __init__(self, name: str, batches, target: Target = Target("cpu")):
        torch.manual_seed(SEED)
        self.target = target
        self.model = target.place(reference_models.get_model(name)).train()
        # the same optimizer convcheck's arms use (TrainConfig's default), so the ratio is fair
        self.opt = (torch.optim.Adam(self.model.parameters(), lr=LR) if OPTIMIZER == "adam"
                    else torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM))
        self.batches = [(target.cast_input(x), target.cast_input(y)) for x, y in batches]
        self.i = 0

    def fwd_bwd(self, i: int | None = None) -> None:
        x, y = self.batches[(self.i if i is None else i) % len(self.batches)]
        t = self.target
        with t.applied():
            with t.runner.autocast():
                out = self.model(x)
            _loss(out, y).backward()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.fwd_bwd()
        with self.target.applied():
            self.opt.step()
        self.i += 1

    def time_step(self) -> float:
        return _timed(self.step, self.target)


class Replays:
    """The float64 replays one ``run_parity`` of ``target`` makes (the measured floors and the intrinsic
    references: ``floor.reference_call`` / ``floor.reference_forward_backward``), recorded in one
    untimed parity run with their operands as parity passed them (already rounded to the target's
    precision) and a float64 copy of the layer, then re-run bare: ``ref(*args)`` under no_grad, or
    forward + ``backward(grad_output)``. Outside convcheck's machinery, in this process: the floor
    replays' own cost, which parity's floor counts (issue 28). A module's own code replayed in float64
    (``own_check``, ResNets' ``out += identity``) is not recorded: that part stays in parity's figure."""

    def __init__(self, build, batch, target: Target):
        self.calls: list[tuple] = []
        judge = JUDGE.runner
        real_call, real_fb = parity_floor.reference_call, parity_floor.reference_forward_backward

        def ref_args(args):
            return tuple(judge.reference(a).clone() if isinstance(a, torch.Tensor) else a for a in args)

        def call(ref, args, j):
            self.calls.append((copy.deepcopy(ref), ref_args(args), None))
            return real_call(ref, args, j)

        def forward_backward(ref, args, grad_output, j):
            self.calls.append((copy.deepcopy(ref), ref_args(args), judge.reference(grad_output).clone()))
            return real_fb(ref, args, grad_output, j)

        real_own = own_check.OwnCodeCheck._measured
        self.own_code = 0

        def own_measured(check, *a, **kw):  # counted, not replayed: its float64 run stays in parity's figure
            self.own_code += 1
            return real_own(check, *a, **kw)

        patched = [(parity_floor, "reference_call", call), (parity_checks, "reference_call", call),
                   (parity_floor, "reference_forward_backward", forward_backward),
                   (own_check.OwnCodeCheck, "_measured", own_measured)]
        saved = [(m, a, getattr(m, a)) for m, a, _ in patched]
        try:
            for m, a, fn in patched:
                setattr(m, a, fn)
            run_parity(build, batch, [target], judge=JUDGE, seed=SEED)
        finally:
            for m, a, fn in saved:
                setattr(m, a, fn)
        self.forward = sum(1 for c in self.calls if c[2] is None)
        self.backward = len(self.calls) - self.forward

    def run(self) -> None:
        for ref, args, grad_output in self.calls:
            if grad_output is None:
                with torch.no_grad():
                    ref(*args)
                continue
            for p in ref.parameters():
                p.grad = None
            args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                         for a in args)
            with torch.enable_grad():
                out = ref(*args)
                (out[0] if isinstance(out, (tuple, list)) else out).backward(grad_output)

    def time(self) -> float:
        return _timed(self.run)


def _host_tag() -> str:
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-")[:20] or "host"
    return f"{host}-{os.cpu_count()}cpu"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - provenance only
        return None


def _git_state() -> dict:
    status = _git("status", "--porcelain", "--", "convcheck", "reference_models") or ""
    return dict(commit=_git("rev-parse", "--short", "HEAD"),
                convcheck_dirty=", ".join(ln.strip() for ln in status.splitlines() if ln.strip()))


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- memory probes (child processes)

def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _release_free_memory() -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark for this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_probe(spec: dict) -> dict:
    """Runs in a fresh child: peak RSS increase of one measurement over a warmed-up baseline."""
    name, batch, steps, what = spec["model"], spec["batch"], spec["steps"], spec["what"]
    resolved = _resolved(name)
    batches = _batches(resolved, batch, max(1, steps))
    # Warm-up: one-time allocations (thread pools, kernel caches) are no part of any figure.
    warm = BareModel(name, batches[:1])
    warm.fwd_bwd(0)
    del warm
    _release_free_memory()

    # Every measurement makes its own models inside it, as parity and training do: the bare
    # figures count the weights of the model they run (until 2026-12-01 they did not, while
    # parity's counted its judge's float64 weights, ResNet-18's 89 MiB, against them).
    run: Callable[[], object]
    if what in ("bare_fwd_bwd", "judge_fwd_bwd"):
        on = Target("cpu") if what == "bare_fwd_bwd" else JUDGE
        run = lambda: BareModel(name, batches[:1], on).fwd_bwd(0)  # noqa: E731
    elif what == "bare_train":
        def run():
            bare = BareModel(name, batches)
            return [bare.step() for _ in range(steps)]
    elif what.startswith("parity:"):
        target = Target.parse(what.split(":", 1)[1])
        build = model_builder(resolved, initial_state(resolved, SEED))
        run = lambda: run_parity(build, batches[0], [target], judge=JUDGE, seed=SEED)  # noqa: E731
    elif what == "train":
        pair = [Target.parse(s) for s in spec["train_targets"]]
        build = model_builder(resolved, initial_state(resolved, SEED))
        arms = make_arms(pair, spec["envelope"], SEED, JUDGE)
        cfg = TrainConfig(steps=steps, seed=SEED)
        run = lambda: run_training(build, batches, arms, cfg)  # noqa: E731
    else:
        raise ValueError(f"unknown memory probe {what!r}")

    _release_free_memory()
    base_rss = _status_kib("VmRSS")
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reset = _reset_peak()
    t0 = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - t0
    del result
    if reset and _status_kib("VmHWM") is not None:
        peak, method = _status_kib("VmHWM"), "VmHWM after clear_refs=5, minus VmRSS before"
        delta = peak - base_rss
    else:  # fallback: growth of the process's lifetime peak (an underestimate if setup peaked higher)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        method, delta = "ru_maxrss delta", peak - maxrss_before
    return dict(what=what, base_rss_mib=base_rss / 1024 if base_rss else None,
                peak_mib=peak / 1024, delta_mib=max(0, delta) / 1024, seconds=seconds, method=method)


def _run_probe_child(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_probe", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(what=spec["what"], error=f"timed out after {timeout:.0f}s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(what=spec["what"], error=f"exit {proc.returncode}: {tail}")
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- timing

class Bench:
    """One model's measurements. Bare float32 samples are also taken between convcheck runs."""

    def __init__(self, name: str, plan: dict, args):
        self.name, self.plan, self.args = name, plan, args
        self.resolved = _resolved(name)
        self.batch, self.steps = plan["batch"], plan["steps"]
        self.batches = _batches(self.resolved, self.batch, self.steps)
        self.state = initial_state(self.resolved, SEED)
        self.build = model_builder(self.resolved, self.state)
        self.bare = BareModel(name, self.batches)
        self.bare_samples: list[float] = []
        self.floor_models: dict[str, BareModel] = {}  # target spec -> the bare model in its precision
        self.floor_samples: dict[str, list[float]] = {}
        self.replays: dict[str, Replays] = {}  # "replays@<target>" -> parity's float64 replays for it
        self.replay_samples: dict[str, list[float]] = {}
        self.out: dict = dict(batch=self.batch, steps=self.steps, input_shape=list(self.resolved.input_shape),
                              params=sum(p.numel() for p in self.bare.model.parameters()))

    def bare_sample(self, n: int = 1) -> None:
        for _ in range(n):
            self.bare_samples.append(self.bare.time_step())

    @property
    def bare_step_s(self) -> float:
        return _median(self.bare_samples)

    def repeat(self, fn: Callable[[], object], target: Target | None = None,
               floors: tuple[str, ...] = ()) -> list[float]:
        """Convcheck runs: optional warm-up, then repeats, each followed by one bare sample and one
        sample of each floor in ``floors`` (the bare step in those targets' precisions), so a load
        that changes during the run moves the floor as it moves convcheck."""
        if self.plan["cc_warmup"]:
            fn()
        samples = []
        for _ in range(self.plan["cc_repeats"]):
            samples.append(_timed(fn, target))
            self.bare_sample()
            self.floor_sample(floors)
        return samples

    def floor_sample(self, specs, n: int = 1) -> None:
        """``n`` samples of the bare step in each target precision of ``specs`` (float32 "cpu": ``bare``)."""
        for spec in specs:
            if spec == "cpu":
                self.bare_sample(n)
                continue
            if spec.startswith("replays@"):
                self.replay_samples[spec].extend(self.replays[spec].time() for _ in range(n))
                continue
            m = self.floor_models[spec]
            self.floor_samples[spec].extend(m.time_step() for _ in range(n))

    def run(self) -> dict:
        p, out = self.plan, self.out
        _log(f"{self.name}: bare (batch {self.batch})")
        self.bare.step()  # warm-up
        self.bare_sample(p["bare_repeats"])

        # bare in each target's precision: the floor of parity and training, sampled here (at least
        # three samples: one sample of a float64 LeNet step moved its parity ratio 0.9x-1.6x) and
        # again after every convcheck run that is held against it (``repeat``)
        specs = sorted({str(Target.parse(s)) for s in (*self.args.parity_targets, *self.args.train_targets,
                                                        str(JUDGE))} - {"cpu"})
        for spec in specs:
            self.floor_models[spec] = m = BareModel(self.name, self.batches, Target.parse(spec))
            m.step()
            self.floor_samples[spec] = []
        self.floor_sample(specs, max(3, p["bare_repeats"] - 2))

        # N consecutive bare steps from fresh weights (one arm's training)
        n_samples = []
        for _ in range(max(1, p["cc_repeats"])):
            m = BareModel(self.name, self.batches)
            n_samples.append(_timed(lambda: [m.step() for _ in range(self.steps)]))
        out["bare_train_n_s"] = _median(n_samples)
        out["bare_train_n_samples"] = n_samples

        # parity, one target at a time
        out["parity"] = {}
        for spec in self.args.parity_targets:
            target = Target.parse(spec)
            _log(f"{self.name}: parity {spec}")
            key = f"replays@{target}"
            self.replays[key] = rp = Replays(self.build, self.batches[0], target)
            rp.run()  # warm-up
            self.replay_samples[key] = []
            self.floor_sample([key], 2)
            samples = self.repeat(lambda: run_parity(self.build, self.batches[0], [target], judge=JUDGE, seed=SEED),
                                  target, floors=(str(JUDGE), str(target), key))
            out["parity"][spec] = dict(seconds=_median(samples), samples=samples, replays_s=_median(
                self.replay_samples[key]), replay_samples=self.replay_samples[key],
                replays=dict(forward=rp.forward, forward_backward=rp.backward, own_code=rp.own_code))
            del self.replays[key]

        # lockstep training on all arms
        pair = [Target.parse(s) for s in self.args.train_targets]
        arms = make_arms(pair, self.args.envelope, SEED, JUDGE)
        cfg = TrainConfig(steps=self.steps, seed=SEED)
        _log(f"{self.name}: training {len(arms)} arms x {self.steps} steps")
        samples = self.repeat(lambda: run_training(self.build, self.batches, arms, cfg),
                              floors=tuple(sorted({str(a.target) for a in arms})))
        out["training"] = dict(seconds=_median(samples), samples=samples, arms=[a.name for a in arms],
                               arm_targets=[str(a.target) for a in arms], envelope=self.args.envelope,
                               targets=self.args.train_targets)

        if self.args.profile:
            out["profile"] = self.profile(pair, arms, cfg)

        # finish the bare figures: each floor the median of all its samples
        self.floor_models.clear()
        floors = {spec: _median(v) for spec, v in self.floor_samples.items()}
        floors["cpu"] = self.bare_step_s
        out["bare_at"] = floors
        out["bare_at_samples"] = self.floor_samples
        out["bare_step_s"] = self.bare_step_s
        out["bare_samples"] = self.bare_samples
        out["bare_spread"] = (max(self.bare_samples) / min(self.bare_samples)) if self.bare_samples else math.nan
        return out

    def profile(self, pair, arms, cfg) -> dict:
        import cProfile
        import pstats

        res = {}
        jobs = {"parity:cpu": lambda: run_parity(self.build, self.batches[0], [Target("cpu")], seed=SEED),
                "training": lambda: run_training(self.build, self.batches, arms, cfg)}
        for label, fn in jobs.items():
            _log(f"{self.name}: profiling {label}")
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            fn()
            prof.disable()
            total = time.perf_counter() - t0
            st = pstats.Stats(prof)
            rows = []
            for (file, line, func), (_, ncalls, tottime, cumtime, _) in st.stats.items():
                rows.append(dict(func=f"{_short(file)}:{line}({func})", ncalls=ncalls,
                                 tottime=round(tottime, 4), cumtime=round(cumtime, 4)))
            by_tot = sorted(rows, key=lambda r: -r["tottime"])[:15]
            cc = [r for r in rows if r["func"].startswith("convcheck/")]
            by_cum = sorted(cc, key=lambda r: -r["cumtime"])[:15]
            res[label] = dict(total_s=total, top_tottime=by_tot, top_convcheck_cumtime=by_cum)
        return res


def _short(file: str) -> str:
    f = file.replace(str(ROOT) + os.sep, "")
    if "site-packages" in f:
        f = f.split("site-packages" + os.sep, 1)[1]
    return f


def bench_compare(args) -> dict:
    """Whole ``compare("lenet")`` with its defaults, against 30 bare lenet steps at batch 32."""
    steps, batch = 30, 32  # compare()'s defaults
    resolved = _resolved("lenet")
    batches = _batches(resolved, batch, steps)
    bare = BareModel("lenet", batches)
    bare.step()
    bare_n = []
    samples, timings = [], []
    compare("lenet")  # warm-up (also the first env probe)
    for _ in range(1 if args.quick else 3):
        m = BareModel("lenet", batches)
        bare_n.append(_timed(lambda: [m.step() for _ in range(steps)]))
        t0 = time.perf_counter()
        r = compare("lenet")
        samples.append(time.perf_counter() - t0)
        timings.append(dict(r.timings))
    pair, _ = default_targets()
    mid = sorted(range(len(samples)), key=lambda i: samples[i])[len(samples) // 2]
    t = timings[mid]
    other = samples[mid] - sum(t.values())
    return dict(seconds=_median(samples), samples=samples, bare_n_s=_median(bare_n), bare_n_samples=bare_n,
                steps=steps, batch=batch, targets=[str(x) for x in pair], envelope=3,
                timings={**t, "env_diagnose_other_s": other})


# --------------------------------------------------------------------------- report

def _rows(results: dict) -> tuple[list[dict], list[dict]]:
    """Flatten into (timing rows, memory rows) for the tables."""
    trows, mrows = [], []
    for name, r in results["models"].items():
        b = r["bare_step_s"]
        trows.append(dict(model=name, what=f"bare step (fp32, batch {r['batch']})", seconds=b, vs_bare=1.0,
                          vs_floor=None, note=f"median of {len(r['bare_samples'])}, spread x{r['bare_spread']:.2f}"))
        for spec, f in r["bare_at"].items():
            if spec == "cpu":
                continue
            trows.append(dict(model=name, what=f"bare step @{spec}", seconds=f, vs_bare=f / b, vs_floor=None,
                              note="floor of that precision"))
        bn = r["bare_train_n_s"]
        trows.append(dict(model=name, what=f"bare x{r['steps']} steps", seconds=bn, vs_bare=bn / (r["steps"] * b),
                          vs_floor=None, note=f"one arm, fresh weights; x bare = vs {r['steps']} x bare step"))
        judge = r["bare_at"][str(JUDGE)]
        for spec, p in r["parity"].items():
            floor = judge + r["bare_at"].get(str(Target.parse(spec)), b)
            replays = p.get("replays_s")
            p.update(floor_s=floor, vs_floor=p["seconds"] / floor)
            note = "floor = bare@judge + bare@target"
            if replays is not None:
                p.update(floor_with_replays_s=floor + replays, vs_floor_with_replays=p["seconds"] / (floor + replays))
                n = p["replays"]
                note += (f"; + {replays:.3f}s float64 replays ({n['forward']} forward, "
                         f"{n['forward_backward']} forward+backward"
                         + (f"; {n['own_code']} own-code replays not counted" if n.get("own_code") else "") + ")")
            trows.append(dict(model=name, what=f"parity {spec}", seconds=p["seconds"], vs_bare=p["seconds"] / b,
                              vs_floor=p["seconds"] / floor, vs_floor_replays=p.get("vs_floor_with_replays"),
                              note=note))
        tr = r["training"]
        n_arms, steps = len(tr["arms"]), r["steps"]
        naive = bn * n_arms
        floor = steps * sum(r["bare_at"][t] for t in tr["arm_targets"])
        per_arm_step = (tr["seconds"] - floor) / (steps * n_arms)
        tr.update(vs_bare_n_x_arms=tr["seconds"] / naive, vs_floor=tr["seconds"] / floor,
                  overhead_per_arm_step_s=per_arm_step)
        trows.append(dict(model=name, what=f"training {n_arms} arms x{steps}", seconds=tr["seconds"],
                          vs_bare=tr["seconds"] / naive, vs_floor=tr["seconds"] / floor,
                          note=f"vs bare x{steps} x {n_arms} arms; +{per_arm_step:.3f}s/arm-step over floor"))
        mem = r.get("memory") or {}
        base = mem.get("bare_fwd_bwd", {}).get("delta_mib")
        for what, m in mem.items():
            if "error" in m:
                mrows.append(dict(model=name, what=what, mib=None, vs_bare=None, note=m["error"]))
                continue
            ref = base
            note = "vs bare fp32 fwd/bwd"
            if what == "train" and "bare_train" in mem and "delta_mib" in mem["bare_train"]:
                ref, note = mem["bare_train"]["delta_mib"], "vs bare_train (one arm, same steps)"
            ratio = m["delta_mib"] / ref if ref else None
            judge_mib = mem.get("judge_fwd_bwd", {}).get("delta_mib")
            if what.startswith("parity:") and judge_mib:
                note += f"; x{m['delta_mib'] / judge_mib:.2f} the judge's fwd/bwd"
            mrows.append(dict(model=name, what=what, mib=m["delta_mib"], vs_bare=ratio, note=note))
    c = results.get("compare")
    if c:
        trows.append(dict(model="lenet", what=f"compare() defaults ({','.join(c['targets'])})",
                          seconds=c["seconds"], vs_bare=c["seconds"] / c["bare_n_s"], vs_floor=None,
                          note=f"vs bare x{c['steps']} steps; " + ", ".join(
                              f"{k.removesuffix('_s')} {v:.2f}s" for k, v in c["timings"].items())))
    return trows, mrows


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _tables(trows, mrows, markdown: bool) -> str:
    t_head = ["model", "measurement", "seconds", "x bare", "x floor", "x floor+replays", "note"]
    t_body = [[r["model"], r["what"], _fmt(r["seconds"], ".3f"), _fmt(r["vs_bare"], ".2f"),
               _fmt(r["vs_floor"], ".2f"), _fmt(r.get("vs_floor_replays"), ".2f"), r["note"]] for r in trows]
    m_head = ["model", "memory probe", "peak RSS +MiB", "x bare", "note"]
    m_body = [[r["model"], r["what"], _fmt(r["mib"], ".1f"), _fmt(r["vs_bare"], ".2f"), r["note"]] for r in mrows]
    out = [_table(t_head, t_body, markdown)]
    if m_body:
        out.append(_table(m_head, m_body, markdown))
    return "\n\n".join(out)


def _table(head, body, markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


def _markdown(results: dict, trows, mrows) -> str:
    m = results["machine"]
    lines = [
        "# convcheck benchmarks: latest run",
        "",
        f"- command: `{results['command']}`",
        f"- when: {results['date']}; results file: `{results['results_file']}`",
        f"- machine: {m['cpu']} x{m['cpus']}, torch {m['torch']} ({m['torch_threads']} threads), "
        f"python {m['python']}; load average {m['loadavg_start']} at start, {m['loadavg_end']} at end",
        f"- code: commit {results['git']['commit']} at start, {results['git_end']['commit']} at end; "
        f"uncommitted changes under convcheck/, reference_models/: {results['git']['convcheck_dirty'] or 'none'}",
        "",
        "Ratios: `x bare` is against one bare float32 step of the same model in the same process "
        "(for `bare x N` and training: N bare steps x arms; for memory: a bare float32 forward/backward "
        "in a fresh child process, its model made inside the measurement as parity makes its own). `x floor` is against the bare model run in each target's own "
        "precision (parity: one judge step + one target step; training: N x the sum over arms). "
        "`x floor+replays` (parity, issue 28) adds to that floor the bare float64 replays of the rows that "
        "need one (every float64 layer call parity made, re-run as plain torch calls in this process).",
        "",
        _tables(trows, mrows, markdown=True),
        "",
    ]
    for name, r in results["models"].items():
        prof = r.get("profile")
        if not prof:
            continue
        lines.append(f"## Profile: {name}")
        for label, p in prof.items():
            lines.append(f"\n{label}: {p['total_s']:.2f}s under cProfile; top by own time:\n")
            lines.append(_table(["function", "calls", "own s", "cum s"],
                                [[r_["func"], str(r_["ncalls"]), f"{r_['tottime']:.3f}", f"{r_['cumtime']:.3f}"]
                                 for r_ in p["top_tottime"][:10]], markdown=True))
        lines.append("")
    return "\n".join(lines) + "\n"


def _history(path: Path) -> str:
    """What ``latest.md`` holds below its table: everything from its first ``## `` heading that this
    script does not write itself (its ``## Profile:`` sections), kept when the table is rewritten."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except OSError:
        return ""
    for i, line in enumerate(lines):
        if line.startswith("## ") and not line.startswith("## Profile: "):
            return "\n" + "".join(lines[i:])
    return ""


# --------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="comma-separated zoo names (default: %(default)s)")
    ap.add_argument("--include-resnet50", action="store_true", help="add resnet50 at batch 2")
    ap.add_argument("--quick", action="store_true",
                    help="fewer repeats, no convcheck warm-up, two memory probes")
    ap.add_argument("--parity-targets", default=",".join(PARITY_TARGETS),
                    help="targets timed one at a time against the judge (default: %(default)s)")
    ap.add_argument("--train-targets", default=None,
                    help="the pair for lockstep training (default: compare()'s default pair here)")
    ap.add_argument("--envelope", type=int, default=3, help="envelope runs K (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=None, help="override N training steps for every model")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for every measurement (default: %(default)s, so that a "
                         "shared or busy machine slows both sides alike; 0 = torch's own default)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="convcheck runs per measurement, after one warm-up run (median; default: the "
                         "model's plan, 1 for ResNets - a single run moves by 20-30%% on a shared machine)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    ap.add_argument("--no-compare", action="store_true", help="skip the whole compare() timing")
    ap.add_argument("--profile", action="store_true", help="cProfile parity:cpu and training per model")
    ap.add_argument("--out-dir", default=str(HERE / "results"), help="where results go (default: %(default)s)")
    ap.add_argument("--_probe", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.parity_targets = [s.strip() for s in args.parity_targets.split(",") if s.strip()]
    if args.train_targets:
        args.train_targets = [s.strip() for s in args.train_targets.split(",") if s.strip()]
    else:
        args.train_targets = [str(t) for t in default_targets()[0]]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.include_resnet50 and "resnet50" not in models:
        models.append("resnet50")
    args.model_list = models
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._probe:
        spec = json.loads(args._probe)
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        print(json.dumps(_memory_probe(spec)), flush=True)
        return 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    for name in args.model_list:
        reference_models.get_spec(name)  # unknown names fail before any work
    for spec in [*args.parity_targets, *args.train_targets]:
        Target.parse(spec).check_available()

    now = _dt.datetime.now(_dt.timezone.utc)
    results: dict = dict(
        schema=SCHEMA, date=now.isoformat(timespec="seconds"),
        command=" ".join([".venv/bin/python", "benchmarks/run.py", *sys.argv[1:]]) if argv is None else repr(argv),
        machine=dict(host=_host_tag(), cpu=_cpu_model(), cpus=os.cpu_count(), torch=torch.__version__,
                     torch_threads=torch.get_num_threads(), python=platform.python_version(),
                     cuda=torch.cuda.is_available(), loadavg_start=_loadavg()),
        git=_git_state(),
        settings=dict(parity_targets=args.parity_targets, train_targets=args.train_targets,
                      envelope=args.envelope, quick=args.quick, repeats=args.repeats, threads=args.threads,
                      lr=LR, momentum=MOMENTUM, seed=SEED),
        models={},
    )
    t_start = time.perf_counter()
    for name in args.model_list:
        plan = dict(MODEL_PLAN.get(name, dict(batch=2, steps=1, bare_repeats=3, cc_repeats=1, cc_warmup=False)))
        if args.quick:
            plan.update(QUICK_PLAN)
            plan["steps"] = max(1, min(plan["steps"], 3))
        if args.repeats:
            plan.update(cc_repeats=max(1, args.repeats), cc_warmup=True)
        if args.steps:
            plan["steps"] = args.steps
        r = Bench(name, plan, args).run()
        if not args.no_memory:
            probes = QUICK_MEMORY_PROBES if args.quick else MEMORY_PROBES
            r["memory"] = {}
            for what in probes:
                _log(f"{name}: memory probe {what}")
                spec = dict(model=name, batch=plan["batch"], steps=plan["steps"], what=what,
                            train_targets=args.train_targets, envelope=args.envelope,
                            threads=args.threads)
                r["memory"][what] = _run_probe_child(spec, timeout=1800)
        results["models"][name] = r
    if not args.no_compare and "lenet" in args.model_list:
        _log("compare('lenet') with defaults")
        results["compare"] = bench_compare(args)
    results["machine"]["loadavg_end"] = _loadavg()
    results["git_end"] = _git_state()  # others may commit while this runs
    results["wall_s"] = time.perf_counter() - t_start

    trows, mrows = _rows(results)
    out_dir = Path(args.out_dir)
    json_path = out_dir / f"{now.strftime('%Y-%m-%dT%H%MZ')}-{_host_tag()}.json"
    try:
        results["results_file"] = str(json_path.relative_to(ROOT))
    except ValueError:
        results["results_file"] = str(json_path)
    results["table"] = dict(timing=trows, memory=mrows)
    _write_atomic(json_path, json.dumps(results, indent=1, default=float) + "\n")
    latest = out_dir / "latest.md"
    _write_atomic(latest, _markdown(results, trows, mrows) + _history(latest))
    print(_tables(trows, mrows, markdown=False))
    print(f"\nwrote {json_path} and {out_dir / 'latest.md'} ({results['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
