"""A compiled run bisected backend by backend (issue 43): which stage of ``torch.compile`` changes the result.

``bisect_backends`` re-runs a compiled watched run's recorded step - the model rebuilt (by value when trusted,
``by_value.load_model``, else its class imported), given the snapshot's parameters, called on the root call's
recorded inputs (a compiled forward is recorded as one layer, the model's output: ``compiled.layers_hidden``),
its output's backward taken with a fixed cotangent - under each backend in ``BACKENDS`` order: ``eager`` (dynamo
only), ``aot_eager`` (+ AOTAutograd), ``aot_eager_decomp_partition`` (+ decompositions and the partitioner),
``inductor`` (+ the generated kernels). The first whose output or parameter gradients differ from eager's beyond
``BACKEND_RTOL`` (or are exactly zero where eager's are not) is the stage that changes them: the thing to report
to PyTorch. Inductor's random ops draw eager's numbers meanwhile (``fallback_random``): a Dropout mask is not a
difference. ``write_repro`` writes a script that needs only torch (the model's record, the inputs, the
backends) next to the report.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from convcheck.numerics.thresholds import BACKEND_RTOL

BACKENDS = ("eager", "aot_eager", "aot_eager_decomp_partition", "inductor")


@dataclass
class Bisection:
    """What each backend gave against eager; ``first``: the first backend that changes the result (None: none)."""

    step: int | None = None
    ran: list[str] = field(default_factory=list)
    differs: dict = field(default_factory=dict)  # backend -> what differs from eager (the first three things)
    errors: dict = field(default_factory=dict)  # backend -> why it did not run
    first: str | None = None
    note: str | None = None  # why nothing was bisected
    repro: str | None = None

    def lines(self) -> list[str]:
        if self.note:
            return [f"backends: not bisected: {self.note}"]
        if self.first is None:
            return [f"backends: {', '.join(self.ran)} give the same output and gradients at step {self.step} "
                    f"(within {BACKEND_RTOL:g}, relative): the compiled run's difference is not one backend's"]
        before = [b for b in self.ran if b != self.first and BACKENDS.index(b) < BACKENDS.index(self.first)]
        out = [f"backends: {' = '.join(before) or 'eager'} agree at step {self.step}; {self.first} is the first to "
               f"change the result: {'; '.join(self.differs[self.first])}"]
        out += [f"backends: {b} did not run: {why}" for b, why in self.errors.items()]
        if self.repro:
            out.append(f"backends: a repro needing only torch: python {self.repro} (attach it to a PyTorch issue)")
        return out

    def to_dict(self) -> dict:
        return {"step": self.step, "ran": list(self.ran), "differs": dict(self.differs), "errors": dict(self.errors),
                "first": self.first, "note": self.note, "repro": self.repro}


def _model(run, trust: bool):
    from convcheck.runformat.by_value import load_model
    from convcheck.analysis.model_import import build_model, model_class

    model, why = load_model(run, trust)
    if model is None:
        cls, why2 = model_class(run.manifest)
        if cls is not None:
            model, why2 = build_model(cls, run.manifest)
        why = why or why2
    return model, why


def _call(run, root: str):
    """``(step, args, kwargs, params)`` of the first snapshot holding the root call and the parameters, or None."""
    from convcheck.analysis.replay import _Unrecorded, _decoder, _tensor

    for entry in run["snapshots"]:
        dtypes = {a["key"]: a["dtype"] for a in entry["arrays"]}
        if f"out/{root}/0/0" not in dtypes or not any(k.startswith("param/") for k in dtypes):
            continue
        snap = run.snapshot(entry["step"])
        floats, i = [], 0
        while f"in/{root}/0/{i}" in snap:
            floats.append(_tensor(snap[f"in/{root}/0/{i}"], dtypes[f"in/{root}/0/{i}"]))
            i += 1
        spec = (entry.get("calls") or {}).get(f"{root}/0")
        if spec is not None:
            exact, j = [], 0
            while f"arg/{root}/0/{j}" in snap:
                exact.append(torch.from_numpy(snap[f"arg/{root}/0/{j}"]))
                j += 1
            try:
                args, kwargs = _decoder(spec, exact, torch.device("cpu"))(floats)
            except (_Unrecorded, IndexError, ValueError, TypeError, RecursionError):
                continue
        else:
            args, kwargs = floats, {}
        params = {k[len("param/"):]: _tensor(snap[k], dtypes[k]) for k in snap if k.startswith("param/")}
        return entry["step"], args, kwargs, params
    return None


def _run_backend(model, backend: str, args, kwargs, seed: int = 0):
    """The output and every parameter's gradient of ``model`` compiled with ``backend``, on a fresh copy."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    twin = copy.deepcopy(model)
    old = inductor_config.fallback_random
    inductor_config.fallback_random = True  # random ops draw eager's numbers: a mask is not a difference
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = torch.compile(twin, backend=backend)(*args, **kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            g = torch.Generator().manual_seed(seed)
            cot = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
            out.backward(cot)
    finally:
        inductor_config.fallback_random = old
        torch._dynamo.reset()
    grads = {n: p.grad.detach().clone() for n, p in twin.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _differs(name: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
    na, nb = float(a.double().norm()), float(b.double().norm())
    if (na > 0) != (nb > 0):
        return f"{name}: norm {nb:.4g} against eager's {na:.4g}" + (" (exactly 0)" if nb == 0 or na == 0 else "")
    if not (math.isfinite(na) and math.isfinite(nb)):
        return f"{name}: norm {nb:.4g} against eager's {na:.4g}" if (math.isfinite(na) != math.isfinite(nb)) else None
    rel = float((a.double() - b.double()).norm()) / max(na, 1e-300)
    return f"{name}: relative difference {rel:.3g} (norm {nb:.4g} against eager's {na:.4g})" if rel > BACKEND_RTOL \
        else None


def bisect_backends(run, trust: bool = False, backends=BACKENDS) -> Bisection:
    """The compiled run ``run`` (a ``reader.WatchedRun``) re-run backend by backend at its first snapshot step."""
    import torch._dynamo

    out = Bisection()
    if not (run.manifest.get("compiled") or {}).get("how"):
        out.note = "the run was not compiled (torch.compile)"
        return out
    model, why = _model(run, trust)
    if model is None:
        out.note = f"the model is not rebuilt here: {why}"
        return out
    root = run.manifest["model"]["class"]
    found = _call(run, root)
    if found is None:
        out.note = "no snapshot holds the compiled model's call (its inputs) with its parameters"
        return out
    out.step, args, kwargs, params = found
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in params:
                p.data = params[n].to(p.dtype) if params[n].dtype != p.dtype else params[n].clone()
    model.train()
    available = set(torch._dynamo.list_backends(exclude_tags=())) | {"eager"}
    ref = None
    for b in backends:
        if b not in available:
            out.errors[b] = "not available in this torch"
            continue
        try:
            got = _run_backend(model, b, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - a backend that fails here is said, the others still run
            out.errors[b] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
            continue
        out.ran.append(b)
        if ref is None:
            ref = got
            continue
        diffs = [d for d in [_differs("the output", ref[0], got[0])] +
                 [_differs(f"{n}'s gradient", g, got[1][n]) for n, g in ref[1].items() if n in got[1]] if d]
        if diffs:
            out.differs[b] = diffs[:3]
            if out.first is None:
                out.first = b
    return out


REPRO = '''"""convcheck: {first} changes the result of this model's step against eager (issue 43 backend bisection).
Needs only torch: python {name}"""
import hashlib, io, pickle, types, sys
from collections import OrderedDict

import torch

HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
SCRIPT = {script!r}  # the definitions of the user's script (imports, classes, functions), or None
ns = None
if SCRIPT is not None:
    mod = types.ModuleType("__repro_script__")
    ns = mod.__dict__
    exec(compile(SCRIPT, "user_script.py", "exec"), ns)


class Loader(pickle.Unpickler):
    def find_class(self, module, name):
        return ns[name] if module == "__main__" else super().find_class(module, name)

    def persistent_load(self, pid):
        if pid[0] == "hooks":
            return OrderedDict()
        _, is_param, shape, dtype, requires_grad, data = pid
        dt = getattr(torch, dtype)
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape).clone() if data \\
            else torch.zeros(shape, dtype=dt)
        return torch.nn.Parameter(t, requires_grad=requires_grad) if is_param else t


saved = torch.load(HERE + "/{data}", weights_only=False)
model = Loader(io.BytesIO(saved["model"])).load()
with torch.no_grad():
    for n, p in model.named_parameters():
        p.data = saved["params"][n].to(p.dtype)
model.train()
import torch._inductor.config as inductor_config
inductor_config.fallback_random = True
results = {{}}
for backend in {backends!r}:
    torch._dynamo.reset()
    import copy
    twin = copy.deepcopy(model)
    torch.manual_seed(0)
    out = torch.compile(twin, backend=backend)(*saved["args"], **saved["kwargs"])
    out = out[0] if isinstance(out, (tuple, list)) else out
    g = torch.Generator().manual_seed(0)
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype))
    results[backend] = {{n: p.grad.double().norm().item() for n, p in twin.named_parameters() if p.grad is not None}}
    results[backend]["(output)"] = out.double().norm().item()
for name in results["eager"]:
    print(name, "  ".join(f"{{b}}={{results[b][name]:.6g}}" for b in results))
'''


def write_repro(run, bisection: Bisection, folder: Path, trust: bool = False) -> str | None:
    """``repro_backends.py`` + ``repro_backends.pt`` in ``folder``: the model's by-value record, the step's
    parameters and inputs, and the backends up to the first that differs; None when the model has no record."""
    from convcheck.runformat.by_value import MAX_PICKLE_BYTES, MAX_SCRIPT_BYTES, MODEL_PICKLE, SCRIPT

    code = run.manifest.get("code")
    if bisection.first is None or not isinstance(code, dict):
        return None
    found = _call(run, run.manifest["model"]["class"])
    if found is None:
        return None
    _, args, kwargs, params = found
    data = run.source.read(MODEL_PICKLE, MAX_PICKLE_BYTES)
    script = None
    if code.get("script"):
        import ast

        raw = run.source.read(SCRIPT, MAX_SCRIPT_BYTES)
        tree = ast.parse(raw)
        keep = [st for st in tree.body if isinstance(st, (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef,
                                                          ast.AsyncFunctionDef))
                or isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None
                and not any(isinstance(n, ast.Call) for n in ast.walk(st.value))]
        script = ast.unparse(ast.Module(body=keep, type_ignores=[]))  # ``by_value._definitions``' filter
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": data, "params": params, "args": args, "kwargs": kwargs}, folder / "repro_backends.pt")
    upto = list(BACKENDS[:BACKENDS.index(bisection.first) + 1])
    (folder / "repro_backends.py").write_text(REPRO.format(first=bisection.first, name="repro_backends.py",
                                                           script=script, data="repro_backends.pt", backends=upto))
    return str(folder / "repro_backends.py")
