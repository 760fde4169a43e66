"""The float64 judge on a watched run: every leaf layer of each snapshot step replayed (the op inside the code
that made the first NaN/Inf is found at record time: ``convcheck/watch/op_probe.py``).

**Replay** (``replay_run``, issue 43): each leaf comes from the model the run kept by value when this user signed
it here or ``--trust-run`` says so (``by_value.load_model``), else from its class imported as below, else - for
torch's own layers - rebuilt from the safe data the manifest keeps (``by_value.rebuild_leaf``); a call the watch
recorded with integers, bools, tuples, None or keyword arguments (``snapshots.arg_spec``) is replayed as it was
made (``_bound``); a step whose parameters moved between the model's forwards (an LBFGS closure's evaluations, SAM)
replays each evaluation's calls with that evaluation's parameters (``kept_calls.params_at``, issue 48); where they were
not kept, or a call's weights changed within an evaluation (``stale_calls``), the call is left out and its layer is
not checked; calls dropped over the snapshot budget are counted, not replayed. What was checked - n of m layers, at which steps, and why not the others - is the ``Replay``'s coverage, which an ``ok``
verdict needs whole (``diagnose/rules/watched_coverage.py``).

The class: when the run recorded its model's class (``model.module`` and
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
"""

from __future__ import annotations

from convcheck.numerics.formats import coarsest_dtype

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

from convcheck.capture import own_code_leaf
from convcheck.runformat.by_value import rebuild_leaf
from convcheck.analysis.kept_calls import (SHOWN_SKIPS, dropped_calls, evaluation_of, evaluations, kept_calls,
                                           kept_lines, params_at, rows_summary)
from convcheck.analysis.model_import import build_model, model_class
from convcheck.measure.parity.checks import check_forward
from convcheck.measure.parity.floor import FloorMeter, reference_call
from convcheck.measure.parity.judge_pass import JudgeCall
from convcheck.measure.parity.local import reference_copy
from convcheck.numerics.metrics import reduction_length
from convcheck.numerics.tolerances import Tolerances
from convcheck.targets.runners.precision import PrecisionModel

RANDOM_LAYERS = (nn.modules.dropout._DropoutNd,)
INDEX_LAYERS = (nn.Embedding, nn.EmbeddingBag)  # called with integer indices: not in a snapshot
_SPECS = {"float16": "cpu:fp16", "bfloat16": "cpu:bf16", "float32": "cpu:float32", "float64": "cpu:float64"}


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
    """What the judge found in one watched run: ``note`` says why nothing (or part) was replayed.

    Coverage (issue 43): ``layers`` are the run's leaf layers (m), a layer is *checked* when at least one of its
    calls has a row, *exact* (``exempt``) when it is torch's own layer whose result is exact or one rounding at
    any precision (a lookup, a dropout mask, an in-place activation) or whose inputs were already NaN/Inf, and
    otherwise not checked, with the reason (``reasons``). ``complete``: every layer checked or exact, at least
    one checked: what an ``ok`` verdict needs (``diagnose/rules/watched_coverage.py``)."""

    judge: str
    note: str | None = None
    rows: list[LayerRow] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    exempt: dict = field(default_factory=dict)  # layer -> why the judge need not replay it
    reasons: dict = field(default_factory=dict)  # layer -> why it was not replayed (its first reason)
    # issue 48: a layer with a kept call left out for want of its parameters (a closure evaluation's not kept) is
    # not checked, whatever its other calls' rows; calls dropped over the snapshot budget are counted, not replayed
    partial: dict = field(default_factory=dict)  # layer -> why some of its kept calls were not replayed
    kept: list = field(default_factory=list)  # what each snapshot step kept of a layer's calls (``kept_calls``)
    dropped: int = 0  # calls dropped over the snapshot budget
    evaluations: dict = field(default_factory=dict)  # step -> (closure evaluations, those replayed)
    repeats: dict = field(default_factory=dict, repr=False)  # (layer, why) -> (index in skipped, count, text)

    @property
    def flagged(self) -> list[LayerRow]:
        return [r for r in self.rows if r.flagged and r.overflow is None]

    @property
    def overflows(self) -> list[LayerRow]:
        return [r for r in self.rows if r.overflow is not None]

    @property
    def checked(self) -> list[str]:
        """The layers with a replayed call and none of their kept calls left out for want of its parameters."""
        done = {r.layer for r in self.rows} - set(self.partial)
        return [n for n in self.layers if n in done] + sorted(done - set(self.layers))

    @property
    def unchecked(self) -> dict:
        """``{layer: why}`` of the run's layers the judge neither replayed (each kept call) nor needs to."""
        done = {r.layer for r in self.rows} - set(self.partial)
        return {n: self.partial.get(n) or self.reasons.get(n) or self.note or "no call of it at a replayed snapshot step"
                for n in self.layers if n not in done and (n not in self.exempt or n in self.partial)}

    @property
    def complete(self) -> bool:
        return bool(self.rows) and not self.unchecked

    def coverage(self) -> str:
        """``n of m layers checked at step(s) ...`` and what was not, in one line."""
        m = len(self.layers) or len(set(self.checked) | set(self.exempt) | set(self.reasons))
        steps = ", ".join(map(str, self.steps)) or "none"
        text = f"the judge checked {len(self.checked)} of {m} layers (snapshot step{'s' if len(self.steps) > 1 else ''} " \
               f"{steps})"
        exact = [n for n in self.layers if n in self.exempt and n not in set(self.checked)]
        if exact:
            text += f"; {len(exact)} exact at any precision ({', '.join(exact[:4])}{', ...' if len(exact) > 4 else ''})"
        missing = self.unchecked
        if missing:
            first = list(missing.items())[:3]
            text += "; not checked: " + "; ".join(f"{n} ({why})" for n, why in first) + \
                (f"; and {len(missing) - 3} more" if len(missing) > 3 else "")
        for step, (n, done) in sorted(self.evaluations.items()):
            text += (f"; step {step}'s {n} closure evaluations each replayed with its own parameters" if done == n else
                     f"; {done} of step {step}'s {n} closure evaluations replayed (the others' parameters were not "
                     "kept)")
        if self.dropped:
            text += (f"; {self.dropped:,} calls dropped over the snapshot budget, not replayed (a layer is checked "
                     "when every call kept of it was)")
        return text

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
        """The replay as JSON, bounded whatever the calls' count (issue 48): rows summarised per layer with its worst
        (``kept_calls.rows_summary``), the first ``SHOWN_SKIPS`` lines of what was not replayed."""
        return {"judge": self.judge, "note": self.note, "steps": list(self.steps),
                "skipped": list(self.skipped[:SHOWN_SKIPS]), "skipped_total": len(self.skipped),
                "layers": list(self.layers), "checked": self.checked, "exempt": dict(self.exempt),
                "unchecked": self.unchecked, "complete": self.complete, "coverage": self.coverage(),
                "kept": list(self.kept), "calls_dropped": self.dropped,
                "closure_evaluations": {str(k): {"evaluations": n, "replayed": d}
                                        for k, (n, d) in sorted(self.evaluations.items())},
                **rows_summary(self.rows)}

    def _said(self, layer: str, text: str, why: str) -> bool:
        """Whether a call of ``layer`` was left out for ``why`` before: counted on its first line, not said again."""
        seen = self.repeats.get((layer, why))
        if seen is None:
            self.repeats[(layer, why)] = (len(self.skipped), 0, text)
            return False
        i, n, first = seen
        self.repeats[(layer, why)] = (i, n + 1, first)
        self.skipped[i] = f"{first} (and {n + 1} more call{'s' if n else ''} of it)"
        return True

    def skip(self, layer: str, text: str, why: str | None = None) -> None:
        """A call not replayed: ``text`` for the report, ``why`` (default: ``text`` after the layer) for coverage."""
        why = why or text.split(": ", 1)[-1]
        if not self._said(layer, text, why):
            self.skipped.append(text)
        self.reasons.setdefault(layer, why)

    def exact(self, layer: str, text: str, why: str) -> None:
        """A call the judge need not replay: exact (or one rounding) at any precision."""
        if not self._said(layer, text, why):
            self.skipped.append(text)
        self.exempt.setdefault(layer, why)

    def unkept(self, layer: str, text: str, why: str) -> None:
        """A kept call whose parameters were not: not replayed, and its layer not checked (never flagged)."""
        self.skip(layer, text, why)
        self.partial.setdefault(layer, why)


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


def _leaf_layers(run) -> list[str]:
    """The run's leaf layers (m of "n of m"): the manifest's, else every layer a step recorded."""
    layers = run.manifest.get("model", {}).get("layers")
    if isinstance(layers, list) and layers:
        return [n for n in layers if isinstance(n, str)]
    seen: dict = {}
    for st in run.steps:
        seen.update(dict.fromkeys(st.get("layers") or {}))
    return list(seen)


class _Leaves:
    """Where each leaf layer comes from: the run's model (by value when trusted, else its class imported here)
    or, for torch's own layers, rebuilt from the manifest's safe data (``by_value.rebuild_leaf``)."""

    def __init__(self, run, trust: bool):
        from convcheck.runformat.by_value import load_model

        self.run = run
        self.model, why = load_model(run, trust)
        self.why = why
        self.how = "by value" if self.model is not None else None
        if self.model is None:
            cls, why2 = model_class(run.manifest)
            if cls is not None:
                self.model, why2 = build_model(cls, run.manifest)
            self.why = why or why2
            self.how = "imported" if self.model is not None else None
        self.modules = dict(self.model.named_modules()) if self.model is not None else {}
        specs = run.manifest.get("model", {}).get("leaf_specs")
        self.specs = specs if isinstance(specs, dict) else {}
        self.rebuilt: dict = {}
        self.missing: set = set()
        m = run.manifest.get("model", {})
        self.root = m.get("class") if [n for n in m.get("layers") or [] if n] == [m.get("class")] else None
        self.unprefixed = all("." not in str(p.get("name")) for p in m.get("parameters") or [] if isinstance(p, dict))

    def prefix(self, layer: str) -> str:
        """How the snapshot names ``layer``'s parameters: ``layer.``, or none when the model is its one leaf (the
        watch names the root by its class; its parameters are the model's own)."""
        return "" if not layer or (layer == self.root and self.unprefixed) else f"{layer}."

    def get(self, layer: str):
        """``(module, None)`` or ``(None, why not)``; a rebuilt layer's parameters are set per step (``load``)."""
        if self.model is not None:
            m = self.modules.get(layer)
            if m is None and self.prefix(layer) == "":  # the model is its own one leaf, named by its class
                m = self.model
            if m is not None or not isinstance(self.specs.get(layer), dict):
                return (m, None) if m is not None else (None, "not a leaf of the model built here")
        if layer not in self.rebuilt:
            spec = self.specs.get(layer)
            if isinstance(spec, dict):
                self.rebuilt[layer] = rebuild_leaf(spec)
            else:
                kind = (self.run.manifest.get("model", {}).get("layer_types") or {}).get(layer, "its class")
                self.rebuilt[layer] = (None, f"{kind} is not torch's own layer and the model was not rebuilt: "
                                             f"{self.why or 'no record of it'}")
        return self.rebuilt[layer]

    def load(self, snap: dict, dtypes: dict, out: "Replay", step: int) -> bool:
        """Each snapshot parameter into the model (or the rebuilt layers); False when the shapes disagree."""
        params = list(self.model.named_parameters()) if self.model is not None else []
        params += [(self.prefix(layer) + n, p) for layer, (m, _) in self.rebuilt.items() if m is not None
                   for n, p in m.named_parameters()]
        wrong = next((n for n, p in params if f"param/{n}" in snap and tuple(snap[f"param/{n}"].shape) != tuple(p.shape)),
                     None)
        if wrong is not None:
            out.skipped.append(f"step {step}: its snapshot's {wrong} is not the shape of the model's")
            return False
        self.missing = {n for n, _ in params if f"param/{n}" not in snap}  # never replayed with made-up weights
        with torch.no_grad():
            for n, p in params:
                key = f"param/{n}"
                if key in snap:
                    t = _tensor(snap[key], dtypes[key])
                    if p.dtype == t.dtype:
                        p.copy_(t)
                    else:  # the run cast its model (.half()): the layer as the run held it
                        p.data = t
        return True


def replay_run(run, judge_spec: str, tol: Tolerances | None = None, trust: bool = False) -> Replay:
    """The float64 judge (``judge_spec``, a float64 target of this machine) on every snapshot step of
    ``run`` (a ``reader.WatchedRun``). ``trust``: load the model recorded by value even when this user's key did
    not sign it (``--trust-run``)."""
    from convcheck.targets.spec import parse_judge

    judge = parse_judge(judge_spec).runner
    out = Replay(str(judge_spec))
    out.layers = _leaf_layers(run)
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
    for entry in run["snapshots"]:  # what each step kept of its layers' calls (issue 48), replayed or not
        if entry["step"] < len(run.steps):
            out.kept += kept_lines(entry)
            out.dropped += dropped_calls(entry)
    chosen = (run.manifest.get("selection") or {}).get("layers")
    if chosen:  # layers= left some out: never recorded, so never replayed - said as such
        seen = {n for st in run.steps for n in (st.get("layers") or {})}
        for n in out.layers:
            if n not in seen:
                out.reasons.setdefault(n, f"not recorded: the watch's layers={chosen!r:.80} left it out")
    if (run.manifest.get("compiled") or {}).get("layers_hidden"):  # its layers ran inside a compiled graph
        for n in out.layers:
            out.reasons.setdefault(n, "it ran inside a compiled graph (torch.compile), whose layer calls the watch "
                                      "does not see")
    leaves = _Leaves(run, trust)
    if leaves.model is None and not leaves.specs:
        out.note = leaves.why or "the run recorded nothing the judge can rebuild its layers from"
        return out
    if leaves.why and leaves.model is None:
        out.skipped.append(f"the model: {leaves.why}; torch's own layers rebuilt from their recorded arguments")
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
        for layer in run.steps[step]["layers"]:
            if leaves.model is None and (run.manifest.get("compiled") or {}).get("layers_hidden") \
                    and layer not in leaves.specs:
                leaves.rebuilt.setdefault(layer, (None, "its layers ran inside a compiled graph"))
            leaves.get(layer)
        if not leaves.load(snap, dtypes, out, step):
            for layer in run.steps[step]["layers"]:
                out.reasons.setdefault(layer, out.skipped[-1].split(": ", 1)[-1])
            continue
        out.steps.append(step)
        _replay_step(run, entry, step, snap, dtypes, leaves, out, judge, tol, cache)
    return out


def _replay_step(run, entry, step, snap, dtypes, leaves, out, judge, tol, cache) -> None:
    """Every kept call of one snapshot step, closure evaluation by evaluation, each with the parameters it ran with
    (issue 48: ``eval/<e>/`` where they moved within the step); an evaluation whose parameters were not kept leaves
    its calls out and their layers not checked (``Replay.unkept``), never flagged."""
    calls = entry.get("calls") if isinstance(entry.get("calls"), dict) else {}
    stale = set(x for x in (entry.get("stale_calls") or []) if isinstance(x, str))
    kept, evs = kept_calls(snap), evaluations(entry)
    ready = {}
    for layer in run.steps[step]["layers"]:
        module, why = leaves.get(layer)
        if module is None and (run.manifest.get("compiled") or {}).get("layers_hidden"):
            out.skip(layer, f"step {step}: its layers ran inside a compiled graph (torch.compile), whose "
                            "layer calls were not seen; the judge replays single layers",
                     "it ran inside a compiled graph")
            continue
        if module is None or any(True for _ in module.children()):
            out.skip(layer, f"step {step}, {layer}: {why or 'not a leaf of the model built here'}")
            continue
        lost = [leaves.prefix(layer) + n for n, _ in module.named_parameters()
                if leaves.prefix(layer) + n in leaves.missing]
        if lost:
            out.skip(layer, f"step {step}, {layer}: its parameter {lost[0]} is not in the snapshot")
            continue
        ready[layer] = module
    by_eval: dict[int, list] = {}
    for layer, module in ready.items():
        for k in kept.get(layer, []):
            by_eval.setdefault(evaluation_of(evs, layer, k), []).append((layer, k))
    replayed = set()
    for e in sorted(by_eval):
        if e and evs[e].get("kept") is not True:
            for layer, k in by_eval[e]:
                out.unkept(layer, f"step {step}, {layer} (call {k}): its parameters at closure evaluation {e} were not "
                                  "kept (over the snapshot budget; their hash was)",
                           "a closure evaluation's parameters were not kept")
            continue
        if e and not leaves.load(*params_at(snap, dtypes, e), out, step):
            continue
        replayed.add(e)
        for layer, k in by_eval[e]:
            if f"{layer}/{k}" in stale:  # its weights changed within an evaluation: not recorded
                out.unkept(layer, f"step {step}, {layer} (call {k}): its parameters had changed since the snapshot "
                                  "took them (an optimizer step inside the step, with no forward of the model "
                                  "between)", "its parameters changed within the step")
                continue
            row = _replay_call(ready[layer], layer, step, k, snap, dtypes, judge, tol, run.manifest, cache, out,
                               run.steps[step].get("autocast"), calls.get(f"{layer}/{k}"))
            if row is not None:
                out.rows.append(row)
    if evs:
        out.evaluations[step] = (len(evs), sum(1 for e in range(len(evs)) if e in replayed or e not in by_eval
                                               and (e == 0 or evs[e].get("kept") is True)))
        leaves.load(snap, dtypes, out, step)  # the step's first parameters back


class _Unrecorded(Exception):
    pass


_DTYPE_NAMES = {"float16", "bfloat16", "float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}


def _decoder(spec: dict, exact: list, device) -> "callable":
    """``floats -> (args, kwargs)``: the call as it was made (``snapshots.arg_spec``), its floating tensors
    taken from the positions the floor meter rounds; raises ``_Unrecorded`` for what was not recorded."""
    def dec(o, fl):
        if not isinstance(o, dict) or len(o) < 1:
            raise _Unrecorded("an argument the record does not describe")
        if "in" in o:
            return fl[int(o["in"])]
        if "arg" in o:
            return exact[int(o["arg"])]
        if "v" in o:
            v = o["v"]
            if not isinstance(v, (bool, int, float, str, type(None))):
                raise _Unrecorded("an argument the record does not describe")
            return v
        if "float" in o:
            return float(str(o["float"]))
        if "dtype" in o:
            if o["dtype"] not in _DTYPE_NAMES:
                raise _Unrecorded(f"a dtype argument {str(o['dtype'])[:20]!r}")
            return getattr(torch, o["dtype"])
        if "device" in o:
            return device
        if "tuple" in o or "list" in o:
            items = [dec(x, fl) for x in (o.get("tuple") or o.get("list") or [])]
            return tuple(items) if "tuple" in o else items
        if "dict" in o and isinstance(o["dict"], dict):
            return {str(k): dec(v, fl) for k, v in o["dict"].items()}
        if "packed" in o and isinstance(o["packed"], list) and len(o["packed"]) == len(PackedSequence._fields):
            return PackedSequence(*(dec(x, fl) for x in o["packed"]))  # torch's own class, nothing of the run's
        raise _Unrecorded(f"an argument of type {str(o.get('opaque', '?'))[:60]} (not recorded)")

    args, kwargs = spec.get("args") or [], spec.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise _Unrecorded("an argument the record does not describe")
    probe = [torch.zeros(())] * 4096
    [dec(a, probe) for a in args], {k: dec(v, probe) for k, v in kwargs.items()}  # unrecorded: said now

    def rebuild(fl):
        return [dec(a, fl) for a in args], {str(k): dec(v, fl) for k, v in kwargs.items()}

    return rebuild


def _bound(module: nn.Module, rebuild) -> nn.Module:
    """``module`` called with its floating inputs only (what the floor meter rounds and the judge casts), the
    rest of the call - integers, tuples, keyword arguments - put back in place: the same class for every
    ``isinstance`` the floors read, the same parameters."""
    cls = type(module)

    def forward(self, *fl):
        a, kw = rebuild(fl)
        return cls.forward(self, *a, **kw)

    bound_cls = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__})
    twin = copy.copy(module)
    twin.__class__ = bound_cls
    return twin


def _replay_call(module, layer, step, k, snap, dtypes, judge, tol, manifest, cache, out,
                 autocast: str | None = None, spec: dict | None = None) -> LayerRow | None:
    where = f"step {step}, {layer}"
    stock = not own_code_leaf(module)
    # the recorded steps trained (the watch records training forwards only), and the run's p is not known
    # here (the model built here takes its class's default arguments): a random layer is never replayed
    if isinstance(module, RANDOM_LAYERS):
        out.exact(layer, f"{where}: a random layer (its draw is not recorded)",
                  "a dropout: a mask and one scaling, one rounding at any precision")
        return None
    if getattr(module, "inplace", False) is True:  # the recorded input is its output already
        text = f"{where}: works in place (its input was not kept)"
        if stock:
            out.exact(layer, text, "torch's elementwise layer, in place: one rounding at any precision")
        else:
            out.skip(layer, text, "works in place: its input was not kept")
        return None
    inputs, i = [], 0
    while f"in/{layer}/{k}/{i}" in snap:
        key = f"in/{layer}/{k}/{i}"
        inputs.append(_tensor(snap[key], dtypes[key]))
        i += 1
    okey = f"out/{layer}/{k}/0"
    got = _tensor(snap[okey], dtypes[okey])
    if not all(bool(torch.isfinite(t).all()) for t in inputs):
        out.exempt.setdefault(layer, "its inputs were already NaN/Inf")
        return None  # NaN/Inf came in: nothing of this layer's
    call = module
    if spec is not None:
        exact, j = [], 0
        while f"arg/{layer}/{k}/{j}" in snap:
            exact.append(judge.reference(torch.from_numpy(snap[f"arg/{layer}/{k}/{j}"])))
            j += 1
        try:
            call = _bound(module, _decoder(spec, exact, judge.torch_device))
        except (_Unrecorded, IndexError, ValueError, TypeError, RecursionError) as exc:
            out.skip(layer, f"{where}: it was called with {exc}", f"called with {exc}")
            return None
    elif isinstance(module, INDEX_LAYERS):  # a run recorded before its integer arguments were: not in the snapshot
        out.exact(layer, f"{where} ({type(module).__name__}): it reads integer indices, which the snapshot does not "
                         "keep (only floating tensors are recorded); a lookup is exact at any precision",
                  "a lookup: exact at any precision")
        return None
    try:
        ref = reference_copy(call, judge)
        judge_out = reference_call(ref, tuple(inputs), judge)
    except Exception as exc:
        out.skip(layer, f"{where}: its recorded inputs do not re-run it ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:120] if str(exc) else 'no message'})",
                 f"its recorded inputs do not re-run it ({type(exc).__name__})")
        return None
    if judge_out is None or tuple(judge_out.shape) != tuple(got.shape):
        out.skip(layer, f"{where}: its replayed output is not the recorded one's shape")
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
        res = check_forward(tol, meter, call, jc, tuple(inputs), got, reduction_length(module, jc.inputs, judge_out))
    except Exception as exc:
        out.skip(layer, f"{where}: its floor could not be measured ({type(exc).__name__})")
        return None
    return LayerRow(step, layer, k, dtype, float(res["local"]), float(res["floor"]), float(res["bound"]),
                    bool(res["flagged"]))
