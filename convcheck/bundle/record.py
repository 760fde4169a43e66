"""``record``: run one target (and the judge it is measured against) and write its bundle.

The stages of ``pipeline.compare`` (``convcheck.stages``) with one target: the shared initial weights, the batches
(made once on the CPU and hashed), the parity step against the judge, lockstep training of the
target, the judge and the target's envelope runs. On top, the target's own parity step is run
once more under hooks that write every leaf call's output to disk as it happens (one layer at a
time in memory), then every parameter's gradient, and parameter snapshots are taken between
training steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fnmatch
import hashlib
import inspect
import math
import platform
from pathlib import Path

import torch

from convcheck.bundle.writer import BundleWriter
from convcheck.capture import LeafCalls, SharedDropoutMasks
from convcheck.plan.config import CompareConfig
from convcheck.plan.seeded_data import hash_state_dict
from convcheck.errors import UsageError
from convcheck.targets.spec import Target

# Snapshot every step while the snapshots of a run stay under this size; else only the last.
AUTO_SNAPSHOT_BYTES = 256 * 1024 * 1024


def parse_snapshot_steps(text: str | None, steps: int, n_params: int) -> list[int]:
    """``"0,10,30"`` -> [0, 10, 30] (parameters after that many steps); ``"none"``; None: every step while
    small (``convcheck diff`` then has the distance between the targets at every step), else the last."""
    if text is None:
        if n_params * 4 * (steps + 1) <= AUTO_SNAPSHOT_BYTES:
            return list(range(steps + 1))
        return [steps]
    if text.strip().lower() == "none":
        return []
    from convcheck.steps import whole_number  # the one step parser (API, environment, command line)

    out = []
    for part in text.split(","):
        try:
            k = whole_number(part, "--snapshot-steps")
        except UsageError:
            raise UsageError(f"--snapshot-steps: {part!r:.40} is not a step number (e.g. 0,10,30)") from None
        if not 0 <= k <= steps:
            raise UsageError(f"--snapshot-steps: step {k} is outside 0..{steps} (--steps {steps})")
        out.append(k)
    return sorted(set(out))


def source_sha256(resolved) -> str | None:
    """SHA-256 of the file the model's factory is defined in (None when there is none)."""
    try:
        path = inspect.getsourcefile(resolved.factory)
    except (TypeError, OSError):
        path = None
    if not path or not Path(path).is_file():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


CODE_OPTIONS = ("data", "loss", "optimizer", "schedule")


def code_files(model_spec: str, config: dict) -> dict[str, str]:
    """``{option: path}`` for every ``FILE.py:name`` the run imports (the model and the options)."""
    out = {}
    for option, spec in (("model", model_spec), *((k, config.get(k)) for k in CODE_OPTIONS)):
        if isinstance(spec, str) and ":" in spec and spec.rsplit(":", 1)[0].endswith(".py"):
            out[option] = spec.rsplit(":", 1)[0]
    return out


def code_hashes(model_spec: str, config: dict) -> dict[str, str]:
    """SHA-256 of each code file the run imports, by option (``diff`` runs none whose bytes differ)."""
    out = {}
    for option, path in code_files(model_spec, config).items():
        try:
            out[option] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            pass
    return out


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return v  # json writes NaN / Infinity, which Python reads back
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if hasattr(v, "item"):
        return v.item()
    return str(v)


def config_dict(cfg: CompareConfig) -> dict:
    """The options of the run, as the CLI would give them (callables are refused: a bundle is rebuilt
    from text)."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.name in ("targets", "judge", "tolerances"):
            continue
        v = getattr(cfg, f.name)
        if callable(v) and not isinstance(v, str):
            raise UsageError(f"cannot record a run whose {f.name} is a Python object; give it as FILE.py:name")
        out[f.name] = _plain(v)
    return out


def _records(df) -> list[dict]:
    return [{k: _plain(v) for k, v in row.items()} for row in df.to_dict("records")]


def record_run(model_spec: str, target_spec: str, cfg: CompareConfig, folder: Path, *, input_shape=None,
               num_classes=None, layers: str | None = None, snapshot_steps: str | None = None,
               fingerprint=None) -> dict:
    """Run ``target_spec`` against the judge and write the bundle into ``folder``; returns the manifest."""
    from convcheck.env import collect
    from convcheck.stages import (caller_rng_kept, guarded, measure_parity, measure_training, prepare, resolve,
                                  threads_chosen, threads_given)

    # --threads in force before the weights or a batch are made, as compare's
    with caller_rng_kept(), threads_given(cfg.threads), guarded(None, cfg.steps), contextlib.ExitStack() as stack:
        run = prepare(resolve(model_spec, dataclasses.replace(cfg, targets=target_spec), input_shape=input_shape,
                              num_classes=num_classes, targets_needed=1))
        cfg, (target,) = run.config, run.config.targets
        made_at = torch.get_num_threads()
        first = run.data.first()
        choice = stack.enter_context(threads_chosen(run, first))  # one count for the target, its envelope, the judge
        if choice.threads != made_at:  # measured: the first batch made again at the count every arm trains at
            first = run.data.first()
        parity = measure_parity(run, first)
        writer = BundleWriter(folder)
        torch.manual_seed(cfg.seed + 1)  # as run_parity seeds the first target's pass
        _capture(run.build(target), target, first, cfg.seed, run.recipe.loss, writer, layers)
        arms = _arms(target, cfg.judge, cfg)
        n_params = sum(v.numel() for v in run.initial_state.values())
        snaps = parse_snapshot_steps(snapshot_steps, cfg.steps, n_params)
        snapper = _Snapshotter(run.build, target, snaps, writer, len(arms))
        training = measure_training(dataclasses.replace(run, build=snapper.build), arms, progress=snapper.progress)
    manifest = _manifest(model_spec, layers, fingerprint or collect(), run=run, target=target, parity=parity,
                         training=training)
    writer.finish(manifest)
    return manifest


def _arms(target: Target, judge: Target, cfg: CompareConfig) -> list:
    """The recorded target (with its envelope runs) and the judge; a float64 target recorded as a judge
    for others (``diff --judge RUN_J``) trains once, as the judge."""
    from convcheck.measure.train.arms import Arm

    if target == judge:
        return [Arm(str(judge), judge, "judge")]
    arms = [Arm(str(target), target, "target"), Arm(str(judge), judge, "judge")]
    for k in range(cfg.envelope):
        arms.append(Arm(f"{target}~{k + 1}", target, "envelope", perturb_seed=(cfg.seed * 1000 + k + 1) % 2**63,
                        reference=str(target)))
    return arms


def _manifest(model_spec, layers, fingerprint, *, run, target, parity, training) -> dict:
    from convcheck import __version__

    resolved, cfg, stream = run.model, run.config, run.data
    return {
        "convcheck_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"spec": model_spec, "name": resolved.name, "source": resolved.source,
                  "source_sha256": source_sha256(resolved),
                  "input_shape": list(resolved.input_shape) if resolved.input_shape else None,
                  "num_classes": resolved.num_classes, "task": resolved.task},
        "target": str(target), "judge": str(cfg.judge), "judge_reason": run.judge_reason,
        "config": config_dict(cfg), "tolerances": _plain(dataclasses.asdict(cfg.tolerances)),
        "layers_pattern": layers, "code_sha256": code_hashes(model_spec, config_dict(cfg)),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                     "numpy": __import__("numpy").__version__},
        "fingerprint": fingerprint.to_dict(),
        "init_sha256": hash_state_dict(run.initial_state), "batch_sha256": list(stream.hashes),
        "batches_sha256": stream.all_hash, "data_source": stream.source, "data_stats": _plain(stream.stats()),
        "notes": list(run.notes),
        "parity": {"judge_loss": parity.judge_loss, "loss": parity.losses.get(target, math.nan),
                   "self_difference": parity.self_difference.get(target, 0.0),
                   "stochastic_layers": list(parity.stochastic_layers), "rows": _records(parity.layers)},
        "training": {"curves": _records(training.curves), "layer_grads": _records(training.layer_grads),
                     "activations": _records(training.activations),
                     "nonfinite_producer": {a.name: list(v) if v else None
                                            for a, v in training.nonfinite_producer.items()},
                     "nonfinite_weights": {a.name: bool(v) for a, v in training.nonfinite_weights.items()},
                     "nonfinite_detail": {a.name: {str(k): _plain(v) for k, v in (d or {}).items()}
                                          for a, d in training.nonfinite_detail.items()}},
    }


def _capture(model, target: Target, batch, seed: int, loss_fn, writer: BundleWriter, layers: str | None) -> None:
    """The target's parity step once more, each leaf call's output written to disk as it is produced,
    then each parameter's gradient with the parity loss scale removed (as ``parity.target_pass``)."""
    runner = target.runner
    x, y = batch

    def on_call(key, name, module, inputs, out):
        if layers is None or fnmatch.fnmatchcase(key, layers) or fnmatch.fnmatchcase(name, layers):
            writer.forward(key, type(module).__name__, out)

    scale = runner.parity_loss_scale
    with runner.applied():
        with SharedDropoutMasks(model, seed), LeafCalls(model, on_call):
            _, loss = runner.forward_loss(model, x, y, loss_fn)
        runner.backward(loss, scale)
    for name, p in model.named_parameters():
        if p.grad is not None and (layers is None or fnmatch.fnmatchcase(name.rsplit(".", 1)[0], layers)
                                   or fnmatch.fnmatchcase(name, layers)):
            writer.grad(name, p.grad.detach() / scale)


class _Snapshotter:
    """Keeps the target arm's model (the first one ``run_training`` builds) and snapshots its
    parameters when every arm has finished a step (read from training's progress, ``(stage, done, total)``)."""

    def __init__(self, build, target: Target, steps: list[int], writer: BundleWriter, n_arms: int):
        self._build, self.target, self.steps, self.writer, self.n_arms = build, target, set(steps), writer, n_arms
        self.model = None

    def build(self, t: Target):
        m = self._build(t)
        if self.model is None and t == self.target:
            self.model = m
            if 0 in self.steps:
                self.writer.snapshot(0, list(m.named_parameters()))
        return m

    def progress(self, stage: str, done: int, total: int) -> None:
        if done % self.n_arms == 0 and done // self.n_arms in self.steps and self.model is not None:
            self.writer.snapshot(done // self.n_arms, list(self.model.named_parameters()))
