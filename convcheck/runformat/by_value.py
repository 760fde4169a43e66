"""The watched model kept so that the float64 judge can rebuild it anywhere (issue 43), and the rule on when what
a run folder holds may be run.

**Safe data** (``leaf_specs``, in the manifest's ``model.leaf_specs``): each of torch's own leaf layers
(``torch.nn.modules.*``: Linear, Conv, LSTMCell, Embedding, norms, activations) as its class name and its plain
attributes (numbers, strings, bools, None, tuples of them) and parameter/buffer names and shapes. The judge
rebuilds such a layer from ``torch.nn``'s own class with those arguments (``rebuild_leaf``): no code of the run is
imported or run, so this works for any run, from any machine.

**By value** (``record_model``): the model's structure pickled once as the block starts (``snapshots/model.pkl``:
every tensor a placeholder of its shape and dtype - the parameters come from each snapshot -, buffers up to
``MAX_BUFFER`` elements by value, the modules' hooks left out), and, when a class or function of it lives in the
user's script (``__main__``), the script's source (``snapshots/script.py.txt``), of which only the imports,
definitions and constant assignments are run, never its loop. A class built with constructor arguments is kept
with them: a pickle restores the built object, it does not call ``__init__`` again.

**Trust** (``trusted``): loading a pickle or running recorded source is running code. It is done only for a run
this user recorded on this machine - the files' SHA-256 signed with HMAC-SHA256 under a key kept in the user's
config folder (``key_path``: ``$CONVCHECK_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/convcheck``, else
``~/.config/convcheck``; made on first use, mode 0600) - or when the user says so (``--trust-run``). Any other
run is replayed from the safe data alone, and what that cannot rebuild is said (``inconclusive``)."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import hmac
import inspect
import io
import json
import math
import os
import pickle
import secrets
import sys
import types
from pathlib import Path

import torch
import torch.nn as nn

MODEL_PICKLE = "snapshots/model.pkl"
SCRIPT = "snapshots/script.py.txt"
MAX_PICKLE_BYTES = 64 * 1024**2
MAX_SCRIPT_BYTES = 4 * 1024**2
MAX_BUFFER = 1 << 20
MAX_REBUILT = 1 << 31  # the most elements a layer rebuilt from safe data may hold (the data is untrusted)  # a buffer (running statistics, a mask) up to this many elements is kept by value
_SCALARS = (bool, int, float, str, type(None))


# --- the user's key ----------------------------------------------------------------------------------------------

def key_path() -> Path:
    base = os.environ.get("CONVCHECK_CONFIG_DIR")
    if base:
        return Path(base) / "key"
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config") / "convcheck" / "key"


def user_key(create: bool) -> bytes | None:
    """The user's signing key (32 random bytes, hex), made with mode 0600 when ``create`` and missing."""
    path = key_path()
    try:
        with open(path, "rb") as f:
            data = f.read(256).strip()
        return data or None
    except FileNotFoundError:
        if not create:
            return None
    except OSError:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        data = secrets.token_hex(32).encode()
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return data
    except FileExistsError:  # made at once by another process
        return user_key(create=False)
    except OSError:
        return None


def _signed(fields: dict) -> bytes:
    return json.dumps({k: fields.get(k) for k in ("pickle_sha256", "script_sha256")}, sort_keys=True).encode()


def sign(fields: dict) -> str | None:
    key = user_key(create=True)
    return hmac.new(key, _signed(fields), hashlib.sha256).hexdigest() if key else None


def signed_here(fields: dict) -> bool:
    """Whether ``fields`` (the manifest's ``code``) carry this user's signature (made with the key here)."""
    key = user_key(create=False)
    mac = fields.get("hmac")
    if key is None or not isinstance(mac, str):
        return False
    return hmac.compare_digest(hmac.new(key, _signed(fields), hashlib.sha256).hexdigest(), mac)


# --- safe data: torch's own leaves -------------------------------------------------------------------------------

def _plain(v, depth: int = 0):
    """``v`` as JSON when it is a number, string, bool, None or a tuple/list of them; else ``...`` (not kept)."""
    if isinstance(v, _SCALARS):
        return v if not isinstance(v, float) or v == v and abs(v) != float("inf") else ...
    if isinstance(v, (tuple, list)) and depth < 3:
        items = [_plain(x, depth + 1) for x in v]
        return ... if any(x is ... for x in items) else {"tuple" if isinstance(v, tuple) else "list": items}
    return ...


def _unplain(v):
    if isinstance(v, dict) and len(v) == 1 and ("tuple" in v or "list" in v):
        items = [_unplain(x) for x in next(iter(v.values()))]
        return tuple(items) if "tuple" in v else items
    return v


def is_stock(cls: type) -> bool:
    return cls.__module__.startswith("torch.nn.modules.") and getattr(nn, cls.__name__, None) is cls


def leaf_specs(leaves: dict) -> dict:
    """``{name: spec}`` of the leaves (``{name: module}``) that are torch's own layers: what ``rebuild_leaf`` needs."""
    out = {}
    for name, m in leaves.items():
        if not is_stock(type(m)):
            continue
        attrs = {}
        for k, v in vars(m).items():
            if k.startswith("_") or k == "training":
                continue
            p = _plain(v)
            if p is not ...:
                attrs[k] = p
        out[name] = {"class": type(m).__name__, "attrs": attrs, "training": m.training,
                     "parameters": {n: list(p.shape) for n, p in m.named_parameters(recurse=False)},
                     "buffers": {n: [list(b.shape), str(b.dtype)[6:]] for n, b in m.named_buffers(recurse=False)}}
    return out


def rebuild_leaf(spec: dict) -> tuple[nn.Module | None, str | None]:
    """torch's own layer from its safe data: the class looked up in ``torch.nn`` (nothing else is ever named),
    built with the recorded values of its constructor's arguments, its other plain attributes set back."""
    name = spec.get("class")
    cls = getattr(nn, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and is_stock(cls)):
        return None, f"its class {str(name)[:60]!r} is not one of torch.nn's layers"
    attrs = {k: _unplain(v) for k, v in (spec.get("attrs") or {}).items() if isinstance(k, str)}
    params = spec.get("parameters") or {}
    sizes = [math.prod(s) for s in params.values() if isinstance(s, list) and all(isinstance(x, int) for x in s)]
    if len(sizes) != len(params) or sum(sizes) > MAX_REBUILT or any(
            isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_REBUILT for v in attrs.values()):
        return None, f"its recorded arguments are not a layer's this judge builds (sizes past {MAX_REBUILT})"
    try:
        sig = inspect.signature(cls.__init__)
        kwargs = {}
        for p in list(sig.parameters.values())[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("device", "dtype"):
                continue
            if p.name in attrs:
                kwargs[p.name] = attrs[p.name]
            elif p.name == "bias" and p.default is True:  # Linear, Conv, LayerNorm: a bias parameter or none
                kwargs["bias"] = "bias" in params or any(n.startswith("bias") for n in params)
            elif p.name == "elementwise_affine" and "weight" not in params:
                kwargs[p.name] = False
            elif p.default is p.empty:
                return None, f"its constructor's argument {p.name!r} was not recorded"
        with torch.random.fork_rng(devices=[]):
            m = cls(**kwargs)
        for k, v in attrs.items():
            if k in vars(m) and k not in kwargs:
                setattr(m, k, v)
    except Exception as exc:  # noqa: BLE001 - the data does not build it: said, not raised
        return None, f"{name} does not build from its recorded arguments ({type(exc).__name__})"
    got = {n: list(p.shape) for n, p in m.named_parameters(recurse=False)}
    if got != {n: list(s) for n, s in params.items()}:
        return None, f"{name} built from its recorded arguments has other parameters than the run's"
    return m.train(bool(spec.get("training", True))), None


# --- by value: the model's structure and the user's script -------------------------------------------------------

class _Pickler(pickle.Pickler):
    def __init__(self, f, hook_ids: set):
        super().__init__(f, protocol=4)
        self.hook_ids = hook_ids

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            data = None
            if not isinstance(obj, nn.Parameter) and t.numel() <= MAX_BUFFER and t.device.type != "meta":
                data = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return ("t", isinstance(obj, nn.Parameter), list(t.shape), str(t.dtype)[6:], bool(obj.requires_grad),
                    data)
        if id(obj) in self.hook_ids:
            return ("hooks", type(obj).__name__)
        return None


def _uses_main(model: nn.Module) -> bool:
    return any(type(m).__module__ == "__main__" for m in model.modules())


def record_model(model: nn.Module, folder: Path, budget: int) -> tuple[dict | None, str | None]:
    """``(the manifest's code entry, None)`` with ``snapshots/model.pkl`` (and the script) written, or
    ``(None, why not)``: a model that does not pickle (a lambda in it), or whose record would take more than
    ``budget`` bytes (a share of ``max_bytes``), is replayed from the safe data alone. The entry's ``bytes`` is
    what was written (counted against ``max_bytes``)."""
    hook_ids = {id(v) for m in model.modules() for k, v in vars(m).items() if "hooks" in k and isinstance(v, dict)}
    buf = io.BytesIO()
    try:
        _Pickler(buf, hook_ids).dump(model)
    except Exception as exc:  # noqa: BLE001 - a lambda, a lock, an open file in the model
        return None, f"the model was not recorded by value ({type(exc).__name__}: {str(exc)[:100]})"
    data = buf.getvalue()
    if len(data) > MAX_PICKLE_BYTES:
        return None, f"the model was not recorded by value (its structure takes {len(data)} bytes)"
    code = {"pickle": MODEL_PICKLE, "pickle_sha256": hashlib.sha256(data).hexdigest(), "script": None,
            "script_sha256": None}
    script = None
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if b"__main__" in data and isinstance(path, str) and path.endswith(".py"):
        with contextlib.suppress(OSError):
            with open(path, "rb") as f:
                script = f.read(MAX_SCRIPT_BYTES + 1)
        if script is not None and len(script) <= MAX_SCRIPT_BYTES:
            code["script"], code["script_sha256"] = SCRIPT, hashlib.sha256(script).hexdigest()
    size = len(data) + (len(script) if code["script"] else 0)
    if size > budget:
        return None, (f"the model was not recorded by value: it takes {size} bytes, more than the {budget} max_bytes "
                      "leaves it")
    from convcheck.files import atomic_write_bytes

    code["bytes"] = size
    atomic_write_bytes(folder / MODEL_PICKLE, data)
    if code["script"]:
        atomic_write_bytes(folder / SCRIPT, script)
    code["hmac"] = sign(code)
    return code, None


def _definitions(source: bytes, filename: str) -> types.CodeType:
    """The script's imports, classes, functions and constant assignments, compiled; never its loop, its calls
    or its ``if __name__ == "__main__":`` block."""
    tree = ast.parse(source, filename=filename)

    def calls(node) -> bool:
        return any(isinstance(n, ast.Call) for n in ast.walk(node))

    keep = [st for st in tree.body
            if isinstance(st, (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            or isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None and not calls(st.value)]
    return compile(ast.Module(body=keep, type_ignores=[]), filename, "exec")


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, script_ns: dict | None):
        super().__init__(f)
        self.script_ns = script_ns

    def find_class(self, module, name):
        if module == "__main__":
            if self.script_ns is None or name not in self.script_ns:
                raise pickle.UnpicklingError(f"{name} of the user's script was not recorded")
            return self.script_ns[name]
        return super().find_class(module, name)

    def persistent_load(self, pid):
        if pid[0] == "hooks":
            from collections import OrderedDict

            return OrderedDict()
        _, is_param, shape, dtype, requires_grad, data = pid
        dt = getattr(torch, dtype)
        if data is not None:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape).clone() if data \
                else torch.empty(shape, dtype=dt)
        else:
            t = torch.zeros(shape, dtype=dt)
        return nn.Parameter(t, requires_grad=requires_grad) if is_param else t


def load_model(run, trust: bool) -> tuple[nn.Module | None, str | None]:
    """The run's model from its by-value record, when the run may be trusted: ``(model, None)`` or
    ``(None, why not)``. Nothing is read past the check when it may not."""
    code = run.manifest.get("code")
    if not isinstance(code, dict) or not isinstance(code.get("pickle_sha256"), str):
        return None, None
    if not (trust or signed_here(code)):
        return None, ("its code was recorded by value, but not signed by this user here: not loaded (a run folder "
                      "from elsewhere is code; pass --trust-run to load it)")
    try:
        data = run.source.read(MODEL_PICKLE, MAX_PICKLE_BYTES)
        if hashlib.sha256(data).hexdigest() != code["pickle_sha256"]:
            return None, f"{MODEL_PICKLE} is not the file the watch wrote (its SHA-256 differs): not loaded"
        ns = None
        if code.get("script"):
            script = run.source.read(SCRIPT, MAX_SCRIPT_BYTES)
            if hashlib.sha256(script).hexdigest() != code.get("script_sha256"):
                return None, f"{SCRIPT} is not the file the watch wrote (its SHA-256 differs): not loaded"
            name = "__convcheck_script__"
            mod = types.ModuleType(name)
            mod.__file__ = str(run.path / SCRIPT)
            ns = mod.__dict__
            sys.modules[name] = mod
            try:
                exec(_definitions(script, str(run.path / SCRIPT)), ns)  # noqa: S102 - a trusted run's definitions
            finally:
                sys.modules.pop(name, None)
        with torch.random.fork_rng(devices=[]):
            model = _Unpickler(io.BytesIO(data), ns).load()
    except Exception as exc:  # noqa: BLE001 - the record does not load here: said, the diff goes on
        return None, f"its recorded model does not load here ({type(exc).__name__}: {str(exc)[:100]})"
    if not isinstance(model, nn.Module):
        return None, "its recorded model is not a torch.nn.Module"
    return model, None
