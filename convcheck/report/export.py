"""Machine-readable output: ``summary.json`` (schema ``convcheck.summary/2``), ``layers.csv``,
``curves.csv``; every file written to a temporary name and renamed into place."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from convcheck.files import atomic_write_bytes, atomic_write_text, write_error
from convcheck.report.folder import REPORT_FILES
from convcheck.report.shared import training_rule
from convcheck.measure.table_schema import CurveRow, frame, named
from convcheck.report.verification import verification_dict

# /2 (issue 24): "verification" added (the verify stage's result: status, line, attempts, cost_ratio)
SUMMARY_SCHEMA = "convcheck.summary/2"


def _clean(value):
    """JSON-safe: NaN/inf -> None, numpy/torch scalars -> Python, dataclasses -> dicts."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _clean(dataclasses.asdict(value))
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def _recipe_dict(result) -> dict:
    """The training recipe as run: the user's callables by name, every number as given."""
    cfg, recipe = result.config, getattr(result, "recipe", None)
    return {
        "loss": recipe.loss_name if recipe else None,
        "optimizer": recipe.optimizer_name.lower() if recipe and isinstance(cfg.optimizer, str)
        and ":" not in cfg.optimizer else (recipe.optimizer_name if recipe else cfg.optimizer),
        "lr": cfg.lr, "momentum": cfg.momentum, "nesterov": cfg.nesterov, "weight_decay": cfg.weight_decay,
        "betas": list(cfg.betas) if cfg.betas else None, "eps": cfg.eps,
        "schedule": recipe.schedule_name.split(" + ")[0] if recipe else cfg.schedule, "warmup": cfg.warmup,
        "clip_grad_norm": cfg.clip_grad_norm,
    }


def summary_dict(result) -> dict:
    """The whole comparison as a JSON-safe dict."""
    cfg = result.config
    parity = result.parity
    training = result.training
    verdict = result.verdict
    fp = result.fingerprint
    return _clean({
        "schema": SUMMARY_SCHEMA,
        "model": {
            "name": result.model.name, "source": result.model.source,
            "input_shape": list(result.model.input_shape) if result.model.input_shape else None,
            "num_classes": result.model.num_classes,
        },
        "targets": [str(t) for t in cfg.targets],
        "judge": str(cfg.judge),
        "judge_reason": result.judge_reason,
        "seed": cfg.seed,
        "config": {
            "steps": cfg.steps, "batch_size": cfg.batch_size, "envelope": cfg.envelope, "tolerances": cfg.tolerances,
            **_recipe_dict(result),
        },
        "data": {"source": result.data_source, "batch_sha256": list(result.batch_hashes),
                 "batches": result.config.steps, "all_batches_sha256": result.batches_hash,
                 "stats": result.data_stats},
        "initial_weights_sha256": result.init_hash,
        "notes": result.notes,
        "parity": {
            "judge_loss": parity.judge_loss,
            "loss": named(parity.losses),
            "first_flagged_layer": named(parity.first_flagged),
            "needed_bound_factor": parity.needed_bound_factor(),
            "layers": parity.layers.to_dict(orient="records"),
        },
        "training": {
            "converged_rule": training_rule(cfg),
            "steps": cfg.steps,
            "arms": [a.name for a in training.arms],
            "per_target": {str(t): dataclasses.asdict(o) for t, o in training.outcomes.items()},
            "envelope": training.envelope,
            "lower_precision": str(training.lower_precision) if training.lower_precision is not None else None,
            "loss": {a.name: [float(v) for v in training.arm_curve(a.name)["loss"]] for a in training.arms},
        },
        "env": {
            "fingerprint": fp.to_dict() if hasattr(fp, "to_dict") else None,
            "findings": [f.to_dict() if hasattr(f, "to_dict") else f for f in result.findings],
        },
        "verdict": verdict.to_dict() if hasattr(verdict, "to_dict") else None,
        "verification": verification_dict(result),
        "timings": result.timings,
        "threads": result.threads.to_dict() if getattr(result, "threads", None) is not None else None,
    })


def prepare_out_dir(out: str | os.PathLike, *, force: bool = True) -> Path:
    """``out`` as a directory to write a report in (created if missing); a report already there is
    refused unless ``force``, and a report file that is not a regular file always (``report.folder``)."""
    from convcheck.report.folder import RunFolder

    return RunFolder.explicit(out, force=force).path


def write_run(result, out: str | os.PathLike, *, plots: bool = True, force: bool = True) -> list[Path]:
    """``summary.json``, ``layers.csv``, ``curves.csv``, ``env.json`` and, with ``plots``,
    ``loss.png``, ``layers.png`` and a self-contained ``report.html`` in ``out``.

    ``summary.json`` is written first with ``"complete": false`` and rewritten with
    ``true`` once every other file is in place, so a full disk halfway leaves a
    summary that says so. A failed write is a one-line ``RunFailed`` (disk full)
    or ``UsageError`` (anything else) naming what was and was not written.
    """
    path = prepare_out_dir(out, force=force)
    summary = summary_dict(result)
    remove_stale(path, ())  # an earlier report's files first: a write failing halfway leaves no mix either
    writer = _Writer(path, plots)
    writer.text("summary.json", json.dumps({**summary, "complete": False}, indent=2) + "\n")
    writer.text("layers.csv", result.parity.layers.to_csv(index=False))
    writer.text("curves.csv", result.training.curves.to_csv(index=False))
    writer.text("env.json", json.dumps(summary["env"], indent=2) + "\n")
    if plots:
        from convcheck.report.html import render_html

        images = render_plots(result)
        if "verify.png" not in images:  # no remedy re-run: none to write
            writer.expected.remove("verify.png")
        for name, data in images.items():
            writer.data(name, data)
        writer.text("report.html", render_html(result, images))
    writer.text("summary.json", json.dumps({**summary, "complete": True}, indent=2) + "\n")
    remove_stale(path, writer.written)
    return writer.written


def remove_stale(path: Path, written) -> None:
    """The report files of an earlier run (replaced with ``--force``) that this run did not write again:
    removed, so that the folder never holds two runs' files side by side (a plot of one beside the
    summary of the other). Only regular files with a report's name; anything else is left alone."""
    keep = {Path(p).name for p in written}
    for name in REPORT_FILES:
        stale = path / name
        if name not in keep and stale.is_file() and not stale.is_symlink():
            stale.unlink()


def write_partial(out: str | os.PathLike, info: dict, parity=None, curves: list | None = None) -> Path:
    """``summary.json`` with ``"complete": false`` and what is known of a run that stopped early; with
    ``parity`` (the one-step check, measured before the stop) also ``layers.csv`` and its summary, with
    ``curves`` (the training rows of the steps completed) ``curves.csv`` and each arm's last loss."""
    path = Path(out) / "summary.json"
    if curves:
        rows = list(curves)  # the steps completed so far
        atomic_write_text(Path(out) / "curves.csv", frame(CurveRow, rows).to_csv(index=False))
        last = {r["arm"]: r["loss"] for r in rows}
        info = {**info, "training": {"steps_done": max(r["step"] for r in rows) + 1, "last_loss": last,
                                     "file": "curves.csv"}}
    if parity is not None:
        atomic_write_text(Path(out) / "layers.csv", parity.layers.to_csv(index=False))
        flagged = parity.flagged()
        info = {**info, "parity": {
            "judge_loss": parity.judge_loss, "losses": named(parity.losses), "first_flagged": named(parity.first_flagged),
            "flagged": [{"target": r.target, "layer": r.layer, "module": r.module, "kind": r.kind}
                        for r in flagged.itertuples()],
            "rows": len(parity.layers), "file": "layers.csv"}}
    atomic_write_text(path, json.dumps(_clean({"schema": SUMMARY_SCHEMA, "complete": False, **info}), indent=2)
                      + "\n")
    remove_stale(Path(out), ["summary.json"] + ["curves.csv"] * bool(curves) + ["layers.csv"] * (parity is not None))
    return path


class _Writer:
    """Writes one report file after another; a failure names what was written and what was not."""

    def __init__(self, path: Path, plots: bool):
        self.path = path
        self.written: list[Path] = []
        self.expected = [n for n in REPORT_FILES if plots or not n.endswith((".png", ".html"))]

    def text(self, name: str, text: str) -> None:
        self.data(name, text.encode("utf-8"))

    def data(self, name: str, data: bytes) -> None:
        target = self.path / name
        try:
            atomic_write_bytes(target, data)
        except OSError as exc:
            done = [p.name for p in self.written]
            summary = "summary.json (complete: false)" if "summary.json" in done else None
            wrote = [summary] + [n for n in done if n != "summary.json"] if summary else done
            missing = [n for n in self.expected if n not in done]
            error = write_error(exc, target)
            raise type(error)(f"{error}; wrote {', '.join(wrote) or 'nothing'} in {self.path}; "
                              f"not written: {', '.join(missing)}") from None
        if target not in self.written:
            self.written.append(target)


def render_plots(result) -> dict[str, bytes]:
    """``loss.png``, ``layers.png`` and, when a remedy was re-run, ``verify.png`` as PNG bytes, by file name
    (here, beside the folder they are written to: ``verify_plot`` draws with ``plots``' helpers)."""
    from convcheck.report.plots import figure_png, layers_figure, loss_figure
    from convcheck.report.verify_plot import verify_figure

    out = {"loss.png": figure_png(loss_figure(result)), "layers.png": figure_png(layers_figure(result))}
    fig = verify_figure(result)
    if fig is not None:
        out["verify.png"] = figure_png(fig)
    return out
