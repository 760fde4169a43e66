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

import copy
import importlib
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from convcheck.capture import tensors_in
from convcheck.diagnose.watched_evidence import magnitude_text  # noqa: F401 - the producer's words, one place
from convcheck.measure.parity.checks import check_forward
from convcheck.measure.parity.floor import FloorMeter, reference_call
from convcheck.measure.parity.judge_pass import JudgeCall
from convcheck.measure.parity.local import reference_copy
from convcheck.measure.train.nonfinite import FirstNonfiniteOp
from convcheck.numerics.metrics import reduction_length
from convcheck.numerics.tolerances import Tolerances
from convcheck.targets.runners.precision import PrecisionModel

RANDOM_LAYERS = (nn.modules.dropout._DropoutNd,)
_SPECS = {"float16": "cpu:fp16", "bfloat16": "cpu:bf16", "float32": "cpu:float32", "float64": "cpu:float64"}


# --- the op inside the producer's code (at record time) -------------------------------------------

class _OpProbe(FirstNonfiniteOp):
    """``FirstNonfiniteOp`` that also keeps the dtype of the producing op's result."""

    def __init__(self):
        super().__init__()
        self.dtype: torch.dtype | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        before = self.found
        out = super().__torch_function__(func, types, args, kwargs)
        if before is None and self.found is not None:
            res = [t for t in tensors_in(out) if t.is_floating_point()]
            self.dtype = res[0].dtype if res else None
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
    return found


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


def model_class(manifest: dict) -> tuple[type | None, str | None]:
    """``(the model's class, None)`` or ``(None, why it is not importable here)``."""
    m = manifest.get("model", {})
    mod, qual = m.get("module"), m.get("qualname")
    if not isinstance(mod, str) or not isinstance(qual, str) or not mod or not qual:
        return None, f"the run did not record its model's module (model class {m.get('class')!r:.60})"
    label = f"{mod}.{qual}"[:200]
    if "<locals>" in qual:
        return None, f"the model's class {label} is defined inside a function: not importable here"
    if mod.split(".")[0] in sys.stdlib_module_names:
        return None, f"{label} names a module of Python's standard library, not a model's"
    if mod == "__main__":
        return None, (f"the model's class {label} was defined in the script itself: not importable here "
                      "(run the script with python -m, or move the class into a module it imports)")
    here = os.getcwd()
    added = here not in sys.path  # as `python -m` has it: the user's modules where diff is run
    if added:
        sys.path.insert(0, here)
    try:
        runs = runs_code_on_import(mod)
        if runs is not None:  # importing it would run the user's script (its training, its argparse)
            name, line, what = runs
            return None, (f"{name} runs code when imported ({what} at line {line}, outside an `if __name__ == "
                          f"\"__main__\":` block): the model's class {label} is not imported; put the model class "
                          "in a module of its own or guard the script")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (Exception, SystemExit) as exc:  # ImportError, AttributeError, whatever the module does on import
        return None, f"the model's class {label} is not importable here ({type(exc).__name__}: " \
                     f"{(str(exc).splitlines() or [''])[0][:100]})"
    finally:
        if added and here in sys.path:
            sys.path.remove(here)
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        return None, f"{label} is not a torch.nn.Module class"
    return obj, None


MAX_SOURCE_BYTES = 4 * 1024**2
# Calls that make a module a training script when its top level makes them (outside a main guard).
_SCRIPT_METHODS = {"parse_args", "parse_known_args", "fit", "backward"}
_EXITS = {"exit", "quit", "_exit"}


def runs_code_on_import(mod: str) -> tuple[str, int, str] | None:
    """``(file name, line, what)`` of the first top-level statement that would run a training script's code
    when ``mod`` (or a package above it) is imported, None when it does not. Read, not executed: each part
    found with ``PathFinder.find_spec`` (which imports no parent package) and parsed with ``ast``. Only the
    user's own files (a source file outside ``site-packages``) are checked; an installed library is imported
    as before; a module already imported runs nothing again; where the finder cannot tell (a namespace
    package not imported yet), the import decides, as before this check."""
    from importlib.machinery import PathFinder
    from importlib.util import find_spec

    search = None
    parts = mod.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        if name in sys.modules:
            search = getattr(sys.modules[name], "__path__", None)
            continue
        try:
            spec = PathFinder.find_spec(name, search)
            if spec is None and i == 0:
                spec = find_spec(name)  # another finder (an editable install's); a top-level name imports nothing
        except Exception:  # noqa: BLE001 - ImportError, ValueError, KeyError (a namespace parent): cannot tell
            return None
        if spec is None:
            return None  # the import says it is not there
        origin = spec.origin if spec.has_location else None
        if isinstance(origin, str) and origin.endswith(".py") and _users_file(origin):
            found = _first_code(origin)
            if found is not None:
                return (os.path.basename(origin), *found)
        search = spec.submodule_search_locations
        if search is None and i < len(parts) - 1:
            return None
    return None


def _users_file(path: str) -> bool:
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    return "site-packages" not in parts and "dist-packages" not in parts


def _first_code(path: str) -> tuple[int, str] | None:
    """``(line, what)`` of the first top-level statement of ``path`` shaped like a script's work, or None.
    A script's work: a ``for``/``while`` loop or a ``with`` block, a call of a function the file defines
    (``main()``, ``train()``, ``model = build()``), ``parse_args()``, ``.fit()``/``.backward()``, an exit.
    Anything else a model file does at import is allowed: constants, ``torch.device(...)``, ``math.sqrt``,
    ``functools.partial``, ``logging.basicConfig``, instances of classes. ``if``/``try`` blocks are read
    through; an ``if __name__ == "__main__":`` block (and its ``else``) is skipped. A file too large,
    unreadable or not Python is left to the import to say."""
    import ast

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SOURCE_BYTES + 1)
        if len(data) > MAX_SOURCE_BYTES:
            return 1, "a file larger than convcheck reads"
        tree = ast.parse(data, filename=path)
    except (OSError, SyntaxError, ValueError, RecursionError):
        return None
    defined = {st.name for st in ast.walk(tree) if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return _scan(tree.body, defined)


def _scan(body: list, defined: set) -> tuple[int, str] | None:
    import ast

    for st in body:
        if isinstance(st, (ast.For, ast.AsyncFor, ast.While)):
            return st.lineno, f"a top-level {'while' if isinstance(st, ast.While) else 'for'} loop"
        if isinstance(st, (ast.With, ast.AsyncWith)):
            return st.lineno, "a top-level with block"
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # bodies run when called; decorators are the library's business
        if isinstance(st, ast.If):
            if _is_main_guard(st.test):
                continue
            found = _scan(st.body, defined) or _scan(st.orelse, defined)
        elif isinstance(st, ast.Try):
            found = (_scan(st.body, defined) or _scan(st.orelse, defined) or _scan(st.finalbody, defined)
                     or next((f for h in st.handlers for f in [_scan(h.body, defined)] if f), None))
        else:
            found = _script_call(st, defined)
        if found is not None:
            return found
    return None


def _script_call(st, defined: set) -> tuple[int, str] | None:
    """A call in ``st`` (outside lambdas, functions and classes defined there) that does a script's work."""
    import ast

    todo = [st]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in defined:
                return node.lineno, f"a call of {f.id}()"
            if isinstance(f, ast.Name) and f.id in _EXITS or isinstance(f, ast.Attribute) and f.attr in _EXITS:
                return node.lineno, "an exit"
            if isinstance(f, ast.Attribute) and f.attr in _SCRIPT_METHODS:
                return node.lineno, f"{f.attr}()"
        todo.extend(ast.iter_child_nodes(node))
    return None


def _is_main_guard(test) -> bool:
    import ast

    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and \
        any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides)


def _build(cls: type, manifest: dict) -> tuple[nn.Module | None, str | None]:
    label = f"{cls.__module__}.{cls.__qualname__}"
    try:
        model = cls()
    except Exception as exc:
        return None, f"the model's class {label} cannot be built without arguments here ({type(exc).__name__}: " \
                     f"{(str(exc).splitlines() or [''])[0][:100]})"
    want = [(p["name"], list(p["shape"])) for p in manifest["model"]["parameters"]]
    got = [(n, list(p.shape)) for n, p in model.named_parameters()]
    if want != got:
        return None, f"{label}() built here has other parameters than the watched model"
    return model.train(), None


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
    model, why = _build(cls, run.manifest)
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
            if module is None or any(True for _ in module.children()):
                out.skipped.append(f"step {step}, {layer}: not a leaf of the model built here")
                continue
            k = 0
            while f"out/{layer}/{k}/0" in snap:
                row = _replay_call(module, layer, step, k, snap, dtypes, judge, tol, run.manifest, cache, out)
                if row is not None:
                    out.rows.append(row)
                k += 1
    return out


def _replay_call(module, layer, step, k, snap, dtypes, judge, tol, manifest, cache, out) -> LayerRow | None:
    where = f"step {step}, {layer}"
    if isinstance(module, RANDOM_LAYERS) and module.training and getattr(module, "p", 0) > 0:
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
    try:
        ref = reference_copy(module, judge)
        judge_out = reference_call(ref, tuple(inputs), judge)
    except Exception as exc:
        out.skipped.append(f"{where}: its recorded inputs do not re-run it ({type(exc).__name__})")
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
    meter = FloorMeter(_precision(dtype, manifest, cache), judge)
    try:
        res = check_forward(tol, meter, module, jc, tuple(inputs), got, reduction_length(module, jc.inputs, judge_out))
    except Exception as exc:
        out.skipped.append(f"{where}: its floor could not be measured ({type(exc).__name__})")
        return None
    return LayerRow(step, layer, k, dtype, float(res["local"]), float(res["floor"]), float(res["bound"]),
                    bool(res["flagged"]))
