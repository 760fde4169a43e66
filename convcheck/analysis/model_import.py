"""The watched run's model class, imported for the float64 replay - safely: the names come from an untrusted
record (``model.module``, ``model.qualname``), so never a standard-library module, never a user's file whose
top level does a script's work (``runs_code_on_import``: read with ``ast``, not imported, so a training script
is not re-run), and built without arguments."""

from __future__ import annotations

import importlib
import os
import sys

import torch.nn as nn

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
    if mod == "convcheck.watch.several":  # models={...}: the watch's own container of them, never a model
        return None, (f"several models were watched in one block ({qual[:120]}): the judge replays one model, "
                      "not the container the watch kept them in")
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


def build_model(cls: type, manifest: dict) -> tuple[nn.Module | None, str | None]:
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
