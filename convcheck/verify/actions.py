"""Remedies as actions: what a verdict's remedy *does* to one arm's run, so that it can be re-run.

An ``Action`` changes at most four things of the failing arm's run, each a pure function of the old one:
the target (``TF32 off``: the same device without TF32), the model as built (``keep in float32``: one
module's parameters and arithmetic in float32 inside a lower-precision model), the recipe (the loss in
float32, the optimizer's eps, the learning rate, the weight decay, gradient clipping) and the global flags
while it runs (deterministic algorithms). ``actions_for(verdict, ...)`` derives the actions that fit a
verdict from its fields (category, sub_cause, layer, target) and the recipe in use, most specific first.
Which actions a verdict asks for is read from its remedies' catalogue entries (``diagnose/catalogue.py``), by id,
never from their words: the actions its remedies name take their slots in the order they are listed, an action
that must be asked for (``NAMED_ONLY``: the loss in float32) is tried only when a remedy names it, and a change an
entry declares with no deriver here is applied as declared (``_declared``). A kind with its own fitting is one
``@action``-registered function (``ACTIONS``); a remedy with an action is one catalogue entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from convcheck.diagnose.catalogue import Change, changes
from convcheck.diagnose.detectors import recipe as R
from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.verdict import Verdict
from convcheck.targets import executors
from convcheck.targets.spec import Target
from convcheck.verify.float32 import float32_loss, float32_snippet, keep_in_float32  # noqa: F401
from convcheck.numerics.thresholds import CLIP_NORM, LOWERED_WEIGHT_DECAY, LR_FACTOR, RAISED_EPS  # noqa: F401
from convcheck.verify.magnitudes import _feeding, _until_in_range, _upto


@dataclass(frozen=True)
class Action:
    """One remedy as something convcheck can apply: ``kind`` (registered), ``text`` (what a reader is told:
    "with 'attn' in float32"), and what it changes: ``modules`` kept in float32, ``eps``, ``lr_factor``,
    ``clip``, ``target`` (a target to run instead), ``deterministic``."""

    kind: str
    text: str
    modules: tuple[str, ...] = ()
    eps: float | None = None
    lr_factor: float | None = None
    clip: float | None = None
    weight_decay: float | None = None  # every group's weight decay lowered to at most this
    loss_float32: bool = False  # the loss computed in float32 on a 16-bit output, outside autocast
    target: Target | None = None
    deterministic: bool = False
    # options of the run's config changed for the re-run, applied through the executors' ``wrap_builder``
    # (``{"ddp_sync_bn": True}``: the data-parallel copies' BatchNorms as SyncBatchNorm)
    settings: tuple[tuple[str, object], ...] = ()

    # --- what the re-run does -------------------------------------------------------------------

    @property
    def changes_recipe(self) -> bool:
        """Whether the judge trains differently too (a recipe change): then the judge is re-run with it."""
        return (self.eps is not None or self.lr_factor is not None or self.clip is not None
                or self.weight_decay is not None)

    def target_for(self, target: Target) -> Target:
        return self.target if self.target is not None else target

    def wrap_build(self, build: Callable[[Target], nn.Module], config=None) -> Callable[[Target], nn.Module]:
        """``build`` with this action's modules kept in float32 in a 16-bit target's model; the judge's
        (float64) and any other target's model as built (a recipe change re-runs the judge beside it).
        ``settings`` go through the executors' ``wrap_builder`` with ``config`` so changed."""
        if self.settings:
            if config is None:
                raise ValueError(f"'{self.text}' changes the run's options and no config was given")
            build = executors.wrap_builder(build, dataclasses.replace(config, **dict(self.settings)))
        if not self.modules:
            return build
        modules = self.modules

        def built(target: Target) -> nn.Module:
            model = build(target)
            return keep_in_float32(model, modules, target) if target.runner.half_compute else model
        return built

    def with_eps(self, eps: float, why: str) -> Action:
        """This action and the optimizer's eps raised to ``eps`` (a second cause the re-run found)."""
        return dataclasses.replace(self, kind=f"{self.kind}+eps", eps=eps,
                                   text=f"{self.text} and the optimizer's eps raised to {eps:g} ({why})")

    def recipe(self, recipe):
        """The recipe with this action's loss, optimizer and clipping changes (the same recipe when it has none).
        The loss in float32 leaves the judge's (a float64 output) as it was: only a 16-bit output is cast."""
        if self.loss_float32:
            recipe = dataclasses.replace(recipe, loss=float32_loss(recipe.loss), source=None)
        if not self.changes_recipe:
            return recipe
        make, eps, factor, decay = recipe.make_optimizer, self.eps, self.lr_factor, self.weight_decay

        def make_optimizer(params):
            opt = make(params)
            for group in opt.param_groups:
                if eps is not None and "eps" in group and group["eps"] < eps:
                    group["eps"] = eps
                if factor is not None:
                    group["lr"] = group["lr"] * factor
                if decay is not None and (group.get("weight_decay") or 0.0) > decay:
                    group["weight_decay"] = decay
            return opt
        clip = recipe.clip_grad_norm if self.clip is None else self.clip
        # ``source=None``: the recipe no longer is what its config fields build (pickled field by field)
        return dataclasses.replace(recipe, make_optimizer=make_optimizer, clip_grad_norm=clip, source=None)

    @contextlib.contextmanager
    def applied(self):
        """The global flags this action sets, restored afterwards."""
        if not self.deterministic:
            yield
            return
        was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was, warn_only=warn)

    def snippet(self) -> str:
        """The change as the user would write it."""
        if self.modules and self.eps is not None:
            return (float32_snippet(self.modules) + "\n" + dataclasses.replace(self, modules=()).snippet() + "\n")
        if self.modules:
            return float32_snippet(self.modules)
        if self.loss_float32:
            return ("with torch.autocast(device_type=out.device.type, enabled=False):\n"
                    "    loss = loss_fn(out.float(), y)  # the loss in float32, whatever the model computes in\n")
        if self.eps is not None:
            return f"optimizer = torch.optim.Adam(model.parameters(), lr=..., eps={self.eps:g})  # --eps {self.eps:g}"
        if self.lr_factor is not None:
            return f"lr = {self.lr_factor:g} * lr"
        if self.weight_decay is not None:
            return (f"for group in optimizer.param_groups:  # your optimizer, as built\n"
                    f"    group['weight_decay'] = min(group['weight_decay'], {self.weight_decay:g})"
                    f"  # --weight-decay {self.weight_decay:g}\n")
        if self.clip is not None:
            return (f"torch.nn.utils.clip_grad_norm_(model.parameters(), {self.clip:g})  # before optimizer.step()"
                    f"; --clip-grad-norm {self.clip:g}")
        if self.target is not None:
            return "torch.backends.cuda.matmul.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = False"
        if self.deterministic:
            return "torch.use_deterministic_algorithms(True)"
        if dict(self.settings).get("ddp_sync_bn"):
            return ("model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # before DistributedDataParallel"
                    "(model); --ddp-sync-bn")
        return ""


Deriver = Callable[["Context"], "Action | None"]
ACTIONS: dict[str, Deriver] = {}


def action(kind: str):
    """Register a deriver: ``fn(context) -> Action | None`` (None: this kind does not fit the verdict)."""
    def register(fn: Deriver) -> Deriver:
        ACTIONS[kind] = fn
        return fn
    return register


@dataclass(frozen=True)
class Context:
    """What the derivers read: the verdict, the failing arm's target (None: no arm to re-run), whether
    that arm is the judge, the model as built for it, and the recipe in use."""

    verdict: Verdict
    target: Target | None
    is_judge: bool
    model: nn.Module | None
    recipe: object
    # the judge's largest output magnitude of every module call, in call order (``judge_magnitudes``), which
    # says how far a kept module's neighbours must stay in float32 too (None: unknown)
    layers: object = None
    config: object = None  # the run's ``CompareConfig`` (the options an action may change), None: unknown

    @property
    def sub_cause(self) -> str:
        return self.verdict.sub_cause or ""


_OVERFLOWS = set(S.NONFINITE_TENSORS) | {S.OUT_OF_RANGE, S.GRADSCALER_COLLAPSE, S.ILL_CONDITIONED,
                                         S.GRADIENT_UNDERFLOW}
_SETUP_STEP = {S.NONFINITE_LOSS, S.EXPLODING_GRADIENTS, S.OSCILLATING_LOSS, S.DEAD_RELUS}


def _has_module(ctx: Context, name: str | None) -> bool:
    if not name or ctx.model is None:
        return False
    try:
        ctx.model.get_submodule(name)
    except AttributeError:
        return False
    return True


@action("float32-module")
def _float32_module(ctx: Context) -> Action | None:
    """A layer or a NaN/Inf producer named in a 16-bit (cast or autocast) target: that module in float32."""
    t, v = ctx.target, ctx.verdict
    if t is None or ctx.is_judge or t.world is not None or not t.runner.half_compute:
        return None
    if v.category not in ("layer", "numerics") or not (v.category == "layer" or ctx.sub_cause in _OVERFLOWS):
        return None
    if not _has_module(ctx, v.layer):
        return None
    calls = _calls(ctx)
    if ctx.sub_cause == S.ILL_CONDITIONED:
        feeding = _feeding(calls, v.layer)
        if feeding:
            names = tuple(n for n in (*feeding, v.layer) if _has_module(ctx, n))
            return Action("float32-module", f"with {_quoted(names)} in float32 ('{v.layer}' and the modules "
                                            f"making its input: {_quoted(feeding)})", modules=names)
    largest = t.runner.precision.narrowest.largest
    after = _until_in_range(calls, v.layer, largest)
    if after:
        names = tuple(n for n in (v.layer, *after) if _has_module(ctx, n))
        fmt = t.runner.precision.narrowest
        return Action("float32-module", f"with {_quoted(names)} in float32 (the judge's values stay above {fmt}'s "
                                        f"{largest:g} from '{v.layer}' {_upto(after, calls, largest)})", modules=names)
    return Action("float32-module", f"with '{v.layer}' in float32", modules=(v.layer,))


# --- how far a kept module's neighbours must stay in float32 (the judge's magnitudes, from parity) ---

def _quoted(names) -> str:
    return ", ".join(f"'{n}'" for n in names)


def _calls(ctx: Context) -> list[tuple[str, float, bool]]:
    """The model's calls in the order they finish: (module name, the judge's largest output magnitude,
    False). ``ctx.layers`` holds them (``judge_magnitudes``: one float64 forward of the judge on the first
    batch); empty when unknown."""
    return list(ctx.layers or [])


def _optimizer_has(recipe, key: str) -> bool:
    probe = torch.zeros(1, requires_grad=True)
    try:
        opt = recipe.make_optimizer([probe])
    except Exception:  # noqa: BLE001 - a factory that wants the model's own parameters: unknown
        return False
    return all(key in g for g in opt.param_groups)


@action("optimizer-eps")
def _optimizer_eps(ctx: Context) -> Action | None:
    """Weights made NaN/Inf by the optimizer step in a 16-bit model: the optimizer's eps raised to 1e-4."""
    if ctx.target is None or ctx.sub_cause != S.NONFINITE_WEIGHTS or not _optimizer_has(ctx.recipe, "eps"):
        return None
    return Action("optimizer-eps", f"with the optimizer's eps raised to {RAISED_EPS:g}", eps=RAISED_EPS)


@action("loss-float32")
def _loss_in_float32(ctx: Context) -> Action | None:
    """The loss function's own code made the first NaN/Inf on a 16-bit target, and a remedy of the verdict asks for
    it in float32 (``NAMED_ONLY``): the loss on the output cast to float32, autocast off (the judge's unchanged)."""
    v = ctx.verdict
    if ctx.target is None or ctx.is_judge or not ctx.target.runner.half_compute:
        return None
    if v.sub_cause != S.NONFINITE_USER_CODE:
        return None
    return Action("loss-float32", "with the loss computed in float32", loss_float32=True)


@action("lower-lr")
def _lower_lr(ctx: Context) -> Action | None:
    """Exploding gradients, a NaN loss, oscillation, dead ReLUs, weights the step makes NaN: 10x lower lr."""
    if ctx.target is None or ctx.sub_cause not in _SETUP_STEP | {S.NONFINITE_WEIGHTS}:
        return None
    return Action("lower-lr", f"with the learning rate {1 / LR_FACTOR:g}x lower", lr_factor=LR_FACTOR)


@action("clip-gradients")
def _clip(ctx: Context) -> Action | None:
    """Exploding gradients or a NaN loss: gradients clipped to norm 1 (unless clipped tighter already)."""
    if ctx.target is None or ctx.sub_cause not in (S.NONFINITE_LOSS, S.EXPLODING_GRADIENTS, S.NONFINITE_WEIGHTS):
        return None
    current = getattr(ctx.recipe, "clip_grad_norm", None)
    if current is not None and current <= CLIP_NORM:
        return None
    return Action("clip-gradients", f"with gradients clipped to norm {CLIP_NORM:g}", clip=CLIP_NORM)


@action("lower-weight-decay")
def _lower_weight_decay(ctx: Context) -> Action | None:
    """Weight decay too strong (lr x weight_decay far above what training undoes): every parameter group's
    weight decay lowered to 1e-4."""
    if ctx.target is None or ctx.sub_cause != R.DECAY_TOO_STRONG:
        return None
    return Action("lower-weight-decay", f"with the weight decay lowered to {LOWERED_WEIGHT_DECAY:g}",
                  weight_decay=LOWERED_WEIGHT_DECAY)


@action("tf32-off")
def _tf32_off(ctx: Context) -> Action | None:
    """A TF32 target (or its emulation) with a layer error or drift: the same device without TF32."""
    t = ctx.target
    if t is None or ctx.is_judge or t.world is not None or not t.runner.tf32_like:
        return None
    if ctx.verdict.category not in ("layer", "numerics"):
        return None
    plain = Target(t.device, t.index, "no-tf32" if t.device == "cuda" else "float32")
    return Action("tf32-off", f"with TF32 off ({plain})", target=plain)


@action("deterministic")
def _deterministic(ctx: Context) -> Action | None:
    """Nondeterministic kernels: torch.use_deterministic_algorithms(True)."""
    if ctx.target is None or ctx.verdict.category != "nondeterminism" or ctx.sub_cause != "nondeterministic kernels":
        return None
    return Action("deterministic", "with deterministic algorithms", deterministic=True)


@action("sync-batchnorm")
def _sync_batchnorm(ctx: Context) -> Action | None:
    """A data-parallel target whose BatchNorm layers normalise each rank's slice on its own (the executor's
    ``batchnorm_per_rank`` finding): the data-parallel arm re-run with SyncBatchNorm (``--ddp-sync-bn``)."""
    t, v = ctx.target, ctx.verdict
    if t is None or t.world is None or ctx.sub_cause != "ddp" or "batchnorm_per_rank" not in v.symptoms:
        return None
    if ctx.config is None or getattr(ctx.config, "ddp_sync_bn", True):
        return None
    return Action("sync-batchnorm", "with SyncBatchNorm (--ddp-sync-bn)", settings=(("ddp_sync_bn", True),))


# most specific first: a module kept in float32 before a recipe change
ORDER = ("float32-module", "loss-float32", "sync-batchnorm", "tf32-off", "optimizer-eps", "lower-weight-decay",
         "clip-gradients", "lower-lr", "deterministic")


# the actions tried only when a remedy of the verdict asks for them (its entry's ``actions``)
NAMED_ONLY = {"loss-float32"}


def named(verdict) -> dict[str, tuple[tuple[int, int], Change]]:
    """The changes the verdict's remedies ask for, by action kind: where each is first listed (remedy, position in
    its text) and the change its entry declares - from the remedies' catalogue entries that answer the verdict's
    cause (``catalogue.changes``), by id."""
    out: dict[str, tuple[tuple[int, int], Change]] = {}
    for at, change in changes(getattr(verdict, "remedies", None), verdict.sub_cause or verdict.category):
        out.setdefault(change.kind, (at, change))
    return out


def actions_for(ctx: Context) -> list[Action]:
    """The actions that fit ``ctx.verdict``, in the order they are tried: ``ORDER``, except that actions the
    verdict's remedies name (``named``) take their slots in the order the remedies list them - the default tries
    one, and it must be the remedy the reader sees first ("lower the learning rate", then "clip gradients", for a
    loss that explodes)."""
    asked = named(ctx.verdict)
    kinds = list(ORDER) + [k for k in ACTIONS if k not in ORDER] + [k for k in asked if k not in ACTIONS]
    out = []
    for kind in kinds:
        if kind in NAMED_ONLY and kind not in asked:
            continue
        a = ACTIONS[kind](ctx) if kind in ACTIONS else _declared(ctx, asked[kind][1])
        if a is not None:
            out.append(a)
    listed = [i for i, a in enumerate(out) if a.kind in asked]
    ranked = sorted((out[i] for i in listed), key=lambda a: asked[a.kind][0])
    for i, a in zip(listed, ranked):
        out[i] = a
    return out


def _declared(ctx: Context, change: Change) -> Action | None:
    """A change a catalogue entry declares with no deriver of its own: applied as declared where it can be (a 16-bit
    target for what keeps float32, a TF32 target for TF32 off, an optimizer with an eps for the eps, the run's config
    for its settings); its text says what it changes."""
    t, v = ctx.target, ctx.verdict
    if t is None:
        return None
    half = not ctx.is_judge and t.world is None and t.runner.half_compute
    if (change.modules_float32 and not (half and _has_module(ctx, v.layer))) or (change.loss_float32 and not half):
        return None
    if change.tf32_off and (ctx.is_judge or t.world is not None or not t.runner.tf32_like):
        return None
    if (change.eps is not None and not _optimizer_has(ctx.recipe, "eps")) or (change.settings and ctx.config is None):
        return None
    plain = Target(t.device, t.index, "no-tf32" if t.device == "cuda" else "float32") if change.tf32_off else None
    parts = [f"'{v.layer}' in float32" if change.modules_float32 else "",
             "the loss computed in float32" if change.loss_float32 else "",
             f"the optimizer's eps raised to {change.eps:g}" if change.eps is not None else "",
             f"the learning rate times {change.lr_factor:g}" if change.lr_factor is not None else "",
             f"gradients clipped to norm {change.clip:g}" if change.clip is not None else "",
             f"the weight decay lowered to {change.weight_decay:g}" if change.weight_decay is not None else "",
             f"TF32 off ({plain})" if plain is not None else "",
             "deterministic algorithms" if change.deterministic else "",
             ", ".join(f"{k}={val}" for k, val in change.settings)]
    return Action(change.kind, "with " + " and ".join(p for p in parts if p),
                  modules=(v.layer,) if change.modules_float32 else (), eps=change.eps, lr_factor=change.lr_factor,
                  clip=change.clip, weight_decay=change.weight_decay, loss_float32=change.loss_float32, target=plain,
                  deterministic=change.deterministic, settings=change.settings)
