"""What a comparison ran and how its arms ended, in the words every report uses - the terminal (``text.py``), the
HTML page, ``assert_parity``'s message: a number as the tables write it (``fmt``), the model and the recipe as
run, whether it is a diff of recorded runs, each trained arm's outcome. No rendering here."""

from __future__ import annotations

import math

from convcheck.diagnose.target_symptoms import ends_apart
from convcheck.measure.table_schema import named
from convcheck.numerics.thresholds import CONVERGENCE_MIN_STEPS


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int,)) and not isinstance(v, bool):
        return str(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(f):
        return "-"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f == 0:
        return "0"
    if 1e-3 <= abs(f) < 1e4:
        return f"{f:.{digits + 2}g}"
    return f"{f:.{digits}e}"


def optimizer_settings(result) -> dict:
    """The optimizer's settings as built (momentum, nesterov, betas, eps, weight decay): its defaults read from
    one built on a dummy parameter, so an SGD's implicit momentum 0.9 shows; the config's values where the
    optimizer cannot be built here (a user factory that fails, no torch)."""
    cfg, recipe = result.config, result.recipe
    given = {"lr": cfg.lr, "momentum": cfg.momentum, "nesterov": cfg.nesterov, "betas": cfg.betas, "eps": cfg.eps,
             "weight_decay": cfg.weight_decay}
    if recipe is None:
        return given
    try:
        import torch

        built = recipe.make_optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults
    except Exception:  # noqa: BLE001 - the user's factory; the config says what was asked
        return given
    return {k: built.get(k, v) for k, v in given.items()}


def recipe_line(result) -> str:
    """``loss cross-entropy; sgd lr 0.05 (momentum 0.9, nesterov, weight decay 0.0005); schedule cosine + 5
    warm-up steps; clip grad norm 1``: the training recipe as run."""
    cfg, recipe = result.config, result.recipe
    settings = optimizer_settings(result)
    extras = [f"{k.replace('_', ' ')} {settings[k]:g}" for k in ("momentum", "weight_decay", "eps")
              if isinstance(settings.get(k), (int, float)) and not isinstance(settings.get(k), bool)
              and settings[k] and (k != "eps" or cfg.eps)]
    extras += ["nesterov"] if settings.get("nesterov") else []
    betas = settings.get("betas") if cfg.betas else None
    extras += [f"betas {betas[0]:g},{betas[1]:g}"] if betas else []
    lr = settings.get("lr") if isinstance(settings.get("lr"), (int, float)) else cfg.lr  # a factory's own lr
    opt = f"{cfg.optimizer if isinstance(cfg.optimizer, str) else recipe.optimizer_name} lr {lr:g}"
    parts = [f"loss {recipe.loss_name if recipe else 'cross-entropy'}", opt + (f" ({', '.join(extras)})" if extras
                                                                                else "")]
    schedule = recipe.schedule_name if recipe else cfg.schedule
    if cfg.warmup and "warm" not in str(schedule):
        schedule = f"{schedule} + {cfg.warmup} warm-up steps"
    parts.append(f"schedule {schedule}")
    if cfg.clip_grad_norm:
        parts.append(f"clip grad norm {cfg.clip_grad_norm:g}")
    return "; ".join(parts)


def model_line(result) -> str:
    """``lenet (zoo, input 1x28x28, 10 classes)``: the model and what it reads, as both reports head them."""
    m = result.model
    shape = f"input {'x'.join(map(str, m.input_shape))}" if m.input_shape else "input shape from the data"
    seen = (result.data_stats or {}).get("y_distinct") if isinstance(result.data_stats, dict) else None
    if m.num_classes:
        classes = f"{m.num_classes} classes"
    elif m.task != "classification":
        classes = m.task
    else:
        classes = f"{seen} classes seen in the data" if seen else "classes from the data"
    return f"{m.name} ({m.source}, {shape}, {classes})"


DIFF_NOTE = "a diff of the recorded runs"  # cli/diff.py's note on a diff's result: the reports title it so


def is_diff(result) -> bool:
    """A comparison of two recorded bundles (``convcheck diff``, ``compare --against``)."""
    return result.model.source == "bundle" or getattr(result, "diff_of", None) is not None


def training_states(result) -> dict[str, str]:
    """Each trained arm's outcome in the words the terminal and ``assert_parity`` both use (plain text):
    ``converged (loss 2.297 -> 0.134)``, ``trained, convergence not judged from 4 step(s) (...)``."""
    judged = result.config.steps >= CONVERGENCE_MIN_STEPS
    states = {}
    judge = result.training.outcomes.get(result.config.judge)
    # an ok verdict while the float64 judge itself has not converged: the run was too short to tell (issue 44)
    too_short = (judged and judge is not None and not judge.converged and math.isfinite(judge.final_loss)
                 and getattr(result.verdict, "category", None) == "ok")
    for name, info in named(result.training.outcomes).items():
        state = "converged" if info.converged else "did not converge"
        if not judged and math.isfinite(info.final_loss):
            state = f"trained, convergence not judged from {result.config.steps} step(s)"
        elif too_short and not info.converged and math.isfinite(info.final_loss):
            state = f"convergence not judged: {result.config.steps} steps, too few for the judge"
        extra = ""
        if (judged and info.converged and judge is not None and judge.converged and name != str(result.config.judge)
                and ends_apart(info.final_loss, judge.final_loss, judge.first_loss)):
            # the convergence rule is relative: a bf16 arm at 51 -> 27 converges by it, the judge ends at 0.75
            extra += f", but ends {info.final_loss / judge.final_loss:.3g}x the judge's {fmt(judge.final_loss, 3)}"
        if info.first_nonfinite_step is not None:
            extra += f", first non-finite at step {info.first_nonfinite_step}"
        if info.skipped_steps:
            extra += f", {info.skipped_steps} steps skipped by GradScaler (scale {fmt(info.final_loss_scale)})"
        if info.first_loss is None or info.first_loss != info.first_loss:
            losses = "no loss recorded" + extra
        else:
            losses = f"loss {fmt(info.first_loss, 3)} -> {fmt(info.final_loss, 3)}{extra}"
        states[name] = f"{state} ({losses})"
    return states
