"""The float64 judge on a watched run: every leaf layer of each snapshot step replayed, and the op
inside the code that made the first NaN/Inf.

**Replay** (``replay_run``): when the run recorded its model's class (``model.module`` and
``model.qualname`` of the manifest) and that class is an ``nn.Module`` importable here (the current
folder on the path, as ``python -m`` has it; never a standard-library module: the names come from an
untrusted bundle) and buildable without arguments, an instance gets each snapshot step's parameters;
every leaf call of the step is then held against its measured floor exactly as ``compare`` holds a
layer's forward
(``measure.parity.checks.check_forward``): the layer's float64 copy on the recorded input is the
judge's output, the recorded output is the target's, and the floor is the layer in float64 on its
operands rounded to the run's precision for that layer (``FloorMeter``; the precision read from the
recorded output's dtype: float32 - TF32 for a CUDA run whose TF32 switches were on -, float16 or
bfloat16 operands with float32 sums). A recorded output that overflowed is not a layer's fault: its
row says how large the judge's values are there (``overflow``). A snapshot without parameters (the one
taken from the first NaN/Inf on), a random layer (dropout), a layer working in place, a call whose
recorded inputs are not all finite or that its forward does not take, is skipped and said so.

**The op** (``live_op``): called by the recorder once, when it finds the first non-finite producer in
a forward: a hook-less copy of the module re-runs on the same inputs under ``FirstNonfiniteOp`` (the
detector ``compare`` uses for own code), with the random state kept: the op that first turned finite
values into NaN/Inf, its float64 magnitude, and the format whose range it passed.
"""

from __future__ import annotations

from convcheck.numerics.formats import coarsest_dtype

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from convcheck.capture import tensors_in
from convcheck.watch.model_import import build_model, model_class
from convcheck.measure.parity.checks import check_forward
from convcheck.measure.parity.floor import FloorMeter, reference_call
from convcheck.measure.parity.judge_pass import JudgeCall
from convcheck.measure.parity.local import reference_copy
from convcheck.measure.train.nonfinite import FirstNonfiniteOp
from convcheck.numerics.metrics import reduction_length
from convcheck.numerics.tolerances import Tolerances
from convcheck.targets.runners.precision import PrecisionModel

RANDOM_LAYERS = (nn.modules.dropout._DropoutNd,)
INDEX_LAYERS = (nn.Embedding, nn.EmbeddingBag)  # called with integer indices: not in a snapshot
_SPECS = {"float16": "cpu:fp16", "bfloat16": "cpu:bf16", "float32": "cpu:float32", "float64": "cpu:float64"}


# --- the op inside the producer's code (at record time) -------------------------------------------

class _OpProbe(FirstNonfiniteOp):
    """``FirstNonfiniteOp`` that also keeps the dtype of the producing op's result."""

    def __init__(self):
        super().__init__()
        self.dtype: torch.dtype | None = None
        self.source: dict | None = None  # the user's line that called the op (``sourceline.caller_line``)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        before = self.found
        out = super().__torch_function__(func, types, args, kwargs)
        if before is None and self.found is not None:
            res = [t for t in tensors_in(out) if t.is_floating_point()]
            self.dtype = res[0].dtype if res else None
            from convcheck.watch.sourceline import caller_line

            self.source = caller_line()
        return out


def live_op(module: nn.Module, args: tuple) -> dict:
    """``{"op", "magnitude", "dtype"}`` of the first op of ``module``'s forward (own code or leaf) that
    turns finite values into NaN/Inf on ``args``; ``{}`` when the re-run does not find it (another
    path, keyword arguments, a module that cannot be copied). Nothing of the caller's changes: a
    hook-less copy runs, without gradients, and the random generators are restored after."""
    devices = sorted({t.device.index or 0 for t in tensors_in(args) if t.device.type == "cuda"})
    probe = _OpProbe()
    try:
        twin = hookless_copy(module)
        with torch.random.fork_rng(devices=devices), torch.no_grad(), probe:
            twin(*args)
    except Exception:  # the module is still named; only its op is not
        return {}
    if probe.found is None:
        return {}
    found = {"op": probe.found[1], "magnitude": probe.magnitude}
    if probe.dtype is not None:
        found["dtype"] = str(probe.dtype).removeprefix("torch.")
    if probe.source is not None and not isinstance(module, _stock_leaf_types()):
        found["source"] = probe.source  # the op's line in the module's own forward
    return found


def _stock_leaf_types() -> tuple:
    """torch's own layers: the op inside one is torch's code, its line the caller's (kept by the recorder)."""
    return (nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
            nn.Embedding, nn.MultiheadAttention, nn.Softmax, nn.LogSoftmax)


def hookless_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without its hooks: they are not copied at all (a hook holding the
    recorder, its open files, cannot be), each replaced by an empty one."""
    memo: dict = {}
    for sub in module.modules():
        for key, value in sub.__dict__.items():
            if "hooks" in key and isinstance(value, dict):
                memo[id(value)] = type(value)()
    return copy.deepcopy(module, memo)


def _largest(dtype) -> float | None:
    try:
        return float(torch.finfo(getattr(torch, dtype)).max) if isinstance(dtype, str) and dtype in _SPECS else None
    except (AttributeError, TypeError):
        return None


# --- the replay at the snapshot steps --------------------------------------------------------------

@dataclass(frozen=True)
class LayerRow:
    """One leaf call replayed: its local error against its measured floor, or its overflow."""

    step: int
    layer: str
    call: int
    dtype: str
    local: float
    floor: float
    bound: float
    flagged: bool
    overflow: float | None = None  # the judge's largest |value| where the recorded output overflowed

    def text(self) -> str:
        where = f"step {self.step}, {self.layer}" + (f" (call {self.call})" if self.call else "")
        if self.overflow is not None:
            return f"{where}: its {self.dtype} output overflows; the judge's values reach {self.overflow:.3g} " \
                   f"> {_largest(self.dtype) or math.inf:.6g}"
        over = self.local / self.floor if self.floor > 0 else (math.inf if self.local > 0 else 0.0)
        return f"{where}: local error {self.local:.3g} against its floor {self.floor:.3g} " \
               f"({over:.3g}x; the bound is {self.bound:.3g})"


@dataclass
class Replay:
    """What the judge found in one watched run: ``note`` says why nothing (or part) was replayed."""

    judge: str
    note: str | None = None
    rows: list[LayerRow] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    @property
    def flagged(self) -> list[LayerRow]:
        return [r for r in self.rows if r.flagged and r.overflow is None]

    @property
    def overflows(self) -> list[LayerRow]:
        return [r for r in self.rows if r.overflow is not None]

    def summary(self) -> str:
        if not self.rows:
            return f"not replayed: {self.note}" if self.note else "no layer call to replay"
        steps = ", ".join(map(str, self.steps))
        bad = len(self.flagged)
        head = (f"{len(self.rows)} layer calls at step{'s' if len(self.steps) > 1 else ''} {steps} replayed: "
                + ("all within their floors" if not bad else
                   f"{bad} above {'its floor' if bad == 1 else 'their floors'}"))
        if self.overflows:
            head += f", {len(self.overflows)} overflowed"
        return head

    def to_dict(self) -> dict:
        return {"judge": self.judge, "note": self.note, "steps": list(self.steps), "skipped": list(self.skipped),
                "rows": [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in vars(r).items()}
                         for r in self.rows]}


def _tensor(a, dtype: str) -> torch.Tensor:
    return torch.from_numpy(a).to(getattr(torch, dtype))


def _precision(dtype: str, manifest: dict, cache: dict) -> PrecisionModel:
    from convcheck.targets.spec import Target

    flags = manifest.get("math_flags", {})
    device = str(manifest["model"].get("device", "cpu"))
    tf32 = dtype == "float32" and device.startswith("cuda") and (
        flags.get("matmul.allow_tf32") is True or flags.get("cudnn.allow_tf32") is True
        or flags.get("float32_matmul_precision") in ("high", "medium"))
    key = (dtype, tf32, flags.get("matmul.allow_tf32"), flags.get("cudnn.allow_tf32"))
    if key not in cache:
        base = Target.parse(_SPECS[dtype]).runner.precision
        if tf32:  # each op class as the run's switches had it
            t = Target.parse("cuda:tf32").runner.precision
            matmul = t.matmul if (flags.get("matmul.allow_tf32") is True or
                                  flags.get("float32_matmul_precision") in ("high", "medium")) else base.matmul
            conv = t.conv if flags.get("cudnn.allow_tf32") is True else base.conv
            base = PrecisionModel(matmul=matmul, conv=conv, elementwise=base.elementwise)
        cache[key] = base
    return cache[key]


def replay_run(run, judge_spec: str, tol: Tolerances | None = None) -> Replay:
    """The float64 judge (``judge_spec``, a float64 target of this machine) on every snapshot step of
    ``run`` (a ``reader.WatchedRun``)."""
    from convcheck.targets.spec import parse_judge

    judge = parse_judge(judge_spec).runner
    out = Replay(str(judge_spec))
    if not any(e["step"] < len(run.steps) for e in run["snapshots"]):  # nothing to replay: say why
        capped = run.manifest.get("skipped_snapshots") or []
        stopped = run.manifest.get("stopped")
        if capped:
            out.note = f"no snapshot was kept: {capped[0]['reason']}"
        elif stopped is not None and stopped["step"] == 0:
            out.note = "the run stopped at step 0, before its first snapshot was kept"
        else:
            out.note = ("the run kept no snapshot (snapshot_steps=() or CONVCHECK_SNAPSHOT_STEPS=none, or none of "
                        "its snapshot steps was reached; the default keeps step 0)")
        return out
    cls, why = model_class(run.manifest)
    if cls is None:
        out.note = why
        return out
    model, why = build_model(cls, run.manifest)
    if model is None:
        out.note = why
        return out
    tol = tol or Tolerances()
    cache: dict = {}
    for entry in run["snapshots"]:
        step = entry["step"]
        if step >= len(run.steps):
            continue
        dtypes = {a["key"]: a["dtype"] for a in entry["arrays"]}
        if not any(k.startswith("param/") for k in dtypes):
            out.skipped.append(f"step {step}: its snapshot holds no parameters ({entry.get('partial') or 'partial'})")
            continue
        snap = run.snapshot(step)
        wrong = next((n for n, p in model.named_parameters()
                      if f"param/{n}" in snap and tuple(snap[f"param/{n}"].shape) != tuple(p.shape)), None)
        if wrong is not None:
            out.skipped.append(f"step {step}: its snapshot's {wrong} is not the shape of the model's")
            continue
        with torch.no_grad():
            for n, p in model.named_parameters():
                key = f"param/{n}"
                if key in snap:
                    t = _tensor(snap[key], dtypes[key])
                    if p.dtype == t.dtype:
                        p.copy_(t)
                    else:  # the run cast its model (.half()): the layer as the run held it
                        p.data = t
        out.steps.append(step)
        modules = dict(model.named_modules())
        for layer in run.steps[step]["layers"]:
            module = modules.get(layer)
            if module is None and (run.manifest.get("compiled") or {}).get("layers_hidden"):
                out.skipped.append(f"step {step}: its layers ran inside a compiled graph (torch.compile), whose "
                                   "layer calls were not seen; the judge replays single layers")
                continue
            if module is None or any(True for _ in module.children()):
                out.skipped.append(f"step {step}, {layer}: not a leaf of the model built here")
                continue
            k = 0
            while f"out/{layer}/{k}/0" in snap:
                row = _replay_call(module, layer, step, k, snap, dtypes, judge, tol, run.manifest, cache, out,
                                   run.steps[step].get("autocast"))
                if row is not None:
                    out.rows.append(row)
                k += 1
    return out


def _replay_call(module, layer, step, k, snap, dtypes, judge, tol, manifest, cache, out,
                 autocast: str | None = None) -> LayerRow | None:
    where = f"step {step}, {layer}"
    # the recorded steps trained (the watch records training forwards only), and the run's p is not known
    # here (the model built here takes its class's default arguments): a random layer is never replayed
    if isinstance(module, RANDOM_LAYERS):
        out.skipped.append(f"{where}: a random layer (its draw is not recorded)")
        return None
    if getattr(module, "inplace", False) is True:  # the recorded input is its output already
        out.skipped.append(f"{where}: works in place (its input was not kept)")
        return None
    inputs, i = [], 0
    while f"in/{layer}/{k}/{i}" in snap:
        key = f"in/{layer}/{k}/{i}"
        inputs.append(_tensor(snap[key], dtypes[key]))
        i += 1
    okey = f"out/{layer}/{k}/0"
    got = _tensor(snap[okey], dtypes[okey])
    if not all(bool(torch.isfinite(t).all()) for t in inputs):
        return None  # NaN/Inf came in: nothing of this layer's
    if isinstance(module, INDEX_LAYERS):  # its input is integer indices, which a snapshot does not keep
        out.skipped.append(f"{where} ({type(module).__name__}): it reads integer indices, which the snapshot does not "
                           "keep (only floating tensors are recorded); a lookup is exact at any precision")
        return None
    try:
        ref = reference_copy(module, judge)
        judge_out = reference_call(ref, tuple(inputs), judge)
    except Exception as exc:
        out.skipped.append(f"{where}: its recorded inputs do not re-run it ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:120] if str(exc) else 'no message'})")
        return None
    if judge_out is None or tuple(judge_out.shape) != tuple(got.shape):
        out.skipped.append(f"{where}: its replayed output is not the recorded one's shape")
        return None
    dtype = dtypes[okey]
    if not bool(torch.isfinite(got).all()):
        absmax = float(judge_out.abs().max()) if judge_out.numel() else 0.0
        limit = _largest(dtype)
        if limit is not None and absmax > limit:
            return LayerRow(step, layer, k, dtype, math.inf, math.nan, math.nan, True, overflow=absmax)
    jc = JudgeCall(layer, type(module).__name__, tuple(judge.reference(t) for t in inputs), judge_out)
    # under autocast a layer computed in the autocast format whatever dtype it handed on (a GRU's float32 output
    # from bfloat16 arithmetic): its floor is that format's
    computed = coarsest_dtype((dtype, autocast)) if autocast in _SPECS else dtype
    meter = FloorMeter(_precision(computed, manifest, cache), judge)
    try:
        res = check_forward(tol, meter, module, jc, tuple(inputs), got, reduction_length(module, jc.inputs, judge_out))
    except Exception as exc:
        out.skipped.append(f"{where}: its floor could not be measured ({type(exc).__name__})")
        return None
    return LayerRow(step, layer, k, dtype, float(res["local"]), float(res["floor"]), float(res["bound"]),
                    bool(res["flagged"]))
