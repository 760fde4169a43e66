"""Reading a watched run (``convcheck.watch/1``), trusting nothing in it.

The same refusals as a recorded bundle's (``bundle/reader.py``: its member and size checks are reused):
a folder or ``.zip`` of regular files, a manifest checked field by field, ``steps.jsonl`` checked line by
line (steps 0..N-1 in order, every field its type), snapshot arrays read with ``allow_pickle=False``
against their declared shapes. A run whose process was killed inside the block (``complete: false``) is
refused; a block that raised or was interrupted closed its record (``stopped``: the exception, its message
and the step) and is read. Anything wrong
is a one-line ``UsageError`` naming the run and the field.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tokenize
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from convcheck.runformat.fields import (BadField, check_fingerprint, dtype_field, get_field, kinds_of, nbytes_of,
                                        sha_field, shape_field)
from convcheck.runformat.members import BundleFiles, safe_member
from convcheck.runformat.statistics import row_fields
from convcheck.runformat.schema import MANIFEST, MAX_MANIFEST_BYTES, NPZ_SLACK, SCHEMAS, STORAGE, WATCH_SCHEMA
from convcheck.errors import UsageError
from convcheck.runformat.layout import MAX_LINE_BYTES, MAX_STEPS_BYTES, STEPS

_Bad = BadField
# a layer's integer/bool tensor arguments (``snapshots.EXACT``, keys ``arg/``), stored as they were
EXACT_STORAGE = {"int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
                 "bool": "bool"}
MAX_SPEC_BYTES = 1 << 16
_NUM = (int, float)


def schema_of(path) -> str | None:
    """The bundle's ``schema`` field (or None when it has no readable manifest): which reader to use."""
    try:
        m = json.loads(BundleFiles(Path(path)).read(MANIFEST, MAX_MANIFEST_BYTES).decode("utf-8"))
    except (_Bad, UnicodeDecodeError, ValueError, RecursionError):
        return None
    s = m.get("schema") if isinstance(m, dict) else None
    return s if s in SCHEMAS else None


def _check_manifest(m) -> None:
    if not isinstance(m, dict):
        raise _Bad(f"manifest is {type(m).__name__}, expected an object")
    if m.get("schema") != WATCH_SCHEMA:
        raise _Bad(f"schema {m.get('schema')!r:.60} is not {WATCH_SCHEMA!r}")
    if not get_field(m, "complete", bool, "manifest"):
        raise _Bad("is incomplete: the process was killed inside its `with convcheck.watch(...)` block, before "
                   "the watch could close its record; diff reads closed records only (a block that raised or was "
                   "interrupted closes its record)")
    steps = get_field(m, "steps", int, "manifest")
    if not 0 <= steps <= 10**8:
        raise _Bad(f"steps = {steps} is outside 0..10^8")
    model = get_field(m, "model", dict, "manifest")
    get_field(model, "class", str, "model")
    for i, p in enumerate(get_field(model, "parameters", list, "model")):
        if not isinstance(p, dict):
            raise _Bad(f"model.parameters[{i}] is {type(p).__name__}, expected an object")
        get_field(p, "name", str, f"model.parameters[{i}]")
        shape_field(p.get("shape"), f"model.parameters[{i}].shape")
    if not all(isinstance(n, str) for n in get_field(model, "layers", list, "model")):
        raise _Bad("model.layers holds a non-string")
    types = get_field(model, "layer_types", dict, "model", optional=True)  # older runs: none
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in (types or {}).items()):
        raise _Bad("model.layer_types holds a non-string")
    specs = get_field(model, "leaf_specs", dict, "model", optional=True) or {}  # issue 43; older: none
    if not all(isinstance(k, str) and isinstance(v, dict) for k, v in specs.items()):
        raise _Bad("model.leaf_specs holds something other than a layer's data")
    code = get_field(m, "code", dict, "manifest", optional=True)  # the model by value, or None
    for k in ("pickle_sha256", "script_sha256"):
        if code is not None and code.get(k) is not None:
            sha_field(code[k], f"code.{k}")
    if code is not None and not isinstance(code.get("hmac"), (str, type(None))):
        raise _Bad("code.hmac is not a string")
    get_field(m, "fingerprint", dict, "manifest")
    get_field(m, "math_flags", dict, "manifest")
    get_field(m, "scaler", bool, "manifest")
    get_field(m, "optimizer", str, "manifest", optional=True)
    if not all(isinstance(n, str) for n in get_field(m, "notes", list, "manifest")):
        raise _Bad("notes holds a non-string")
    settings = get_field(m, "optimizer_settings", list, "manifest", optional=True)  # older: none
    for i, g in enumerate(settings or []):
        ok = isinstance(g, dict) and all(
            isinstance(k, str) and (v is None or isinstance(v, (bool, float)) or isinstance(v, str) and len(v) <= 60 or
                                    isinstance(v, list) and len(v) <= 4 and all(isinstance(x, float) for x in v))
            for k, v in g.items())
        if not ok:
            raise _Bad(f"optimizer_settings[{i}] is not an object of numbers, booleans, short strings and short "
                       "lists of numbers")
    stopped = get_field(m, "stopped", dict, "manifest", optional=True)  # older runs: no field
    if stopped is not None:
        for key, kind in (("exception", str), ("message", str), ("step", int)):
            get_field(stopped, key, kind, "stopped")
        if not 0 <= stopped["step"] <= 10**8:
            raise _Bad(f"stopped.step = {stopped['step']} is outside 0..10^8")
    failed = get_field(m, "watch_error", dict, "manifest", optional=True)  # an error of the watch's own, or None
    if failed is not None:
        for key, kind in (("exception", str), ("message", str), ("where", str), ("step", int)):
            get_field(failed, key, kind, "watch_error")
    sampler = get_field(m, "sampler", dict, "manifest", optional=True)  # older runs: none
    if sampler is not None:
        get_field(sampler, "shuffle", bool, "sampler")
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in get_field(sampler, "epochs", list, "sampler")):
            raise _Bad("sampler.epochs holds a non-integer")
    compiled = get_field(m, "compiled", dict, "manifest", optional=True)  # older runs: none
    if compiled is not None:
        get_field(compiled, "how", str, "compiled", optional=True)
        get_field(compiled, "layers_hidden", bool, "compiled")
        get_field(compiled, "fallback_random", bool, "compiled", optional=True)
    p = get_field(m, "first_nonfinite", dict, "manifest", optional=True)
    if p is not None:
        for key, kind in (("layer", str), ("step", int), ("direction", str), ("kind", str)):
            get_field(p, key, kind, "first_nonfinite")
        if p["direction"] not in ("forward", "backward"):
            raise _Bad(f"first_nonfinite.direction is {p['direction']!r:.40}, not forward or backward")
    _check_snapshots(get_field(m, "snapshots", list, "manifest"))
    skipped = get_field(m, "skipped_snapshots", list, "manifest", optional=True) or []
    for i, e in enumerate(skipped):  # the snapshot steps the size cap left out (older runs: no field)
        where = f"skipped_snapshots[{i}]"
        if not isinstance(e, dict):
            raise _Bad(f"{where} is {type(e).__name__}, expected an object")
        for key, kind in (("step", int), ("bytes", int), ("reason", str)):
            get_field(e, key, kind, where)


def _check_snapshots(snaps: list) -> None:
    files = set()
    for i, e in enumerate(snaps):
        where = f"snapshots[{i}]"
        if not isinstance(e, dict):
            raise _Bad(f"{where} is {type(e).__name__}, expected an object")
        f = safe_member(get_field(e, "file", str, where))
        if not f.startswith("snapshots/") or not f.endswith(".npz") or f in files:
            raise _Bad(f"{where}.file {f!r:.60} is not a fresh snapshots/*.npz name")
        files.add(f)
        get_field(e, "step", int, where)
        if e.get("sha256") is not None:  # older runs: none
            sha_field(e["sha256"], f"{where}.sha256")
        stored: dict[str, tuple] = {}
        keys = set()
        for j, a in enumerate(get_field(e, "arrays", list, where)):
            if not isinstance(a, dict):
                raise _Bad(f"{where}.arrays[{j}] is not an object")
            key = get_field(a, "key", str, f"{where}.arrays[{j}]")
            if key in keys:
                raise _Bad(f"{where}.arrays[{j}].key {key!r:.60} is listed twice")
            keys.add(key)
            shape_field(a.get("shape"), f"{where}.arrays[{j}].shape")
            if not (key.startswith("arg/") and a.get("dtype") in EXACT_STORAGE):  # an integer/bool argument
                dtype_field(a.get("dtype"), f"{where}.arrays[{j}].dtype")
            first = get_field(a, "same_as", str, f"{where}.arrays[{j}]", optional=True)
            if first is None:
                stored[key] = (a["shape"], a["dtype"])
            elif stored.get(first) != (a["shape"], a["dtype"]):
                raise _Bad(f"{where}.arrays[{j}].same_as {first!r:.60} is not an earlier stored array "
                           "of the same shape and dtype")
        calls = get_field(e, "calls", dict, where, optional=True) or {}
        for name, spec in calls.items():  # the arguments of calls (``snapshots.arg_spec``): read, never run
            if not isinstance(spec, dict) or len(json.dumps(spec)) > MAX_SPEC_BYTES:
                raise _Bad(f"{where}.calls[{name!r:.40}] is not a call's arguments")
        _check_kept(e, where)


def _check_kept(e: dict, where: str) -> None:
    """A snapshot's closure evaluations and what it kept of each layer's calls over its budget (issue 48; older runs:
    neither)."""
    for i, ev in enumerate(get_field(e, "evaluations", list, where, optional=True) or []):
        at = f"{where}.evaluations[{i}]"
        if not isinstance(ev, dict):
            raise _Bad(f"{at} is not an object")
        sha_field(ev.get("sha256"), f"{at}.sha256")
        if not all(isinstance(k, str) and isinstance(v, int) and v >= 0
                   for k, v in get_field(ev, "calls", dict, at).items()):
            raise _Bad(f"{at}.calls is not an object of call counts")
        get_field(ev, "kept", bool, at, optional=True)
    kept = get_field(e, "kept", dict, where, optional=True)
    if kept is not None:
        get_field(kept, "budget", (int, type(None)), f"{where}.kept")
        for name, row in get_field(kept, "layers", dict, f"{where}.kept").items():
            ok = isinstance(row, dict) and all(isinstance(row.get(k), int) and row[k] >= 0 for k in ("calls", "kept"))
            if not ok or not all(row.get(r) is None or isinstance(row[r], int) for r in ("first", "last", "worst",
                                                                                         "nonfinite")):
                raise _Bad(f"{where}.kept.layers[{name!r:.40}] is not a layer's kept calls")


def _check_step(rec, i: int) -> dict:
    where = f"{STEPS} line {i + 1}"
    if not isinstance(rec, dict):
        raise _Bad(f"{where} is {type(rec).__name__}, expected an object")
    if get_field(rec, "step", int, where) != i:
        raise _Bad(f"{where} is step {rec['step']}, expected step {i} (steps 0..N-1 in order)")
    get_field(rec, "loss", _NUM, where, optional=True)
    if not all(isinstance(v, _NUM) and not isinstance(v, bool) for v in get_field(rec, "lr", list, where)):
        raise _Bad(f"{where}.lr holds a non-number")
    hashes = get_field(rec, "batch_sha256", list, where)
    for h in hashes:
        sha_field(h, f"{where}.batch_sha256")
    get_field(rec, "model_eval", bool, where, optional=True)  # only on a step trained in eval mode
    get_field(rec, "layers_recorded", bool, where, optional=True)  # only on a step left out
    get_field(rec, "clip_before_unscale", bool, where, optional=True)  # a GradScaler misused
    get_field(rec, "step_without_scaler", bool, where, optional=True)  # scaled gradients applied
    rounded = get_field(rec, "batch_rounded", list, where, optional=True)  # runs before it: none
    if rounded is not None:
        if len(rounded) != len(hashes):
            raise _Bad(f"{where}.batch_rounded lists {len(rounded)} batches, batch_sha256 {len(hashes)}")
        for r in rounded:
            if r is not None and not isinstance(r, dict):
                raise _Bad(f"{where}.batch_rounded holds {type(r).__name__}, expected an object or null")
            for fmt, h in (r or {}).items():
                sha_field(h, f"{where}.batch_rounded[{fmt!r:.20}]")
    for n, v in get_field(rec, "grad_norms", dict, where).items():
        if not isinstance(v, _NUM) or isinstance(v, bool):
            raise _Bad(f"{where}.grad_norms[{n!r:.40}] is not a number")
    for name, row in get_field(rec, "layers", dict, where).items():
        if not isinstance(row, dict):
            raise _Bad(f"{where}.layers[{name!r:.40}] is not an object")
        _check_layer_row(row, f"{where}.layers[{name!r:.40}]")
        if row["dtype"] not in STORAGE:
            raise _Bad(f"{where}.layers[{name!r:.40}].dtype is {row['dtype']!r:.40}, not a floating dtype")
    get_field(rec, "scale", _NUM, where, optional=True)
    _check_recipe_fields(rec, where)
    return rec


def _check_layer_row(row: dict, where: str) -> None:
    """A layer's row against the declared statistics (``statistics.py``): each of its kind; one a run recorded
    before it was declared may lack (``optional``); a call index within the row's calls."""
    for col, (kind, optional, nullable) in row_fields().items():
        get_field(row, col, kind, where, optional=optional or nullable or type(None) in kinds_of(kind))
    for col in ("worst_call", "nonfinite_call"):
        i = row.get(col)
        if i is not None and not 0 <= i < row["calls"]:
            raise _Bad(f"{where}.{col} = {i} is outside the row's {row['calls']} calls")


def _check_recipe_fields(rec: dict, where: str) -> None:
    """The step's recipe fields (``recipe.py``; runs before them have none): the autocast dtype, the modules in
    another training mode, a few entries of each gradient."""
    for key in ("autocast", "loss_dtype"):
        fmt = get_field(rec, key, (str, type(None)), where, optional=True)
        if fmt is not None and fmt not in STORAGE:
            raise _Bad(f"{where}.{key} is {fmt!r:.40}, not a floating dtype")
    autocast = get_field(rec, "autocast", (str, type(None)), where, optional=True)
    if autocast is not None and autocast not in STORAGE:
        raise _Bad(f"{where}.autocast is {autocast!r:.40}, not a floating dtype")
    for h in get_field(rec, "target_sha256", list, where, optional=True) or []:
        sha_field(h, f"{where}.target_sha256")
    for r in get_field(rec, "target_rounded", list, where, optional=True) or []:
        if r is not None and not (isinstance(r, dict) and all(isinstance(v, str) for v in r.values())):
            raise _Bad(f"{where}.target_rounded holds {type(r).__name__}, expected an object of hashes or null")
    if get_field(rec, "memory_format", str, where, optional=True) not in (None, "channels_last"):
        raise _Bad(f"{where}.memory_format is {rec['memory_format']!r:.40}, not channels_last")
    unchecked = get_field(rec, "grads_unchecked", dict, where, optional=True) or {}
    if not all(isinstance(n, str) and isinstance(c, int) and not isinstance(c, bool) and c > 0
               for n, c in unchecked.items()):
        raise _Bad(f"{where}.grads_unchecked holds something other than layer names and call counts")
    evaluations = get_field(rec, "closure_evaluations", int, where, optional=True)
    if evaluations is not None and evaluations < 2:
        raise _Bad(f"{where}.closure_evaluations is {evaluations}, expected 2 or more")
    modes = get_field(rec, "modes_differ", list, where, optional=True) or []
    if not all(isinstance(m, str) for m in modes):
        raise _Bad(f"{where}.modes_differ holds a non-name")
    for n, v in (get_field(rec, "grad_sample", dict, where, optional=True) or {}).items():
        if not isinstance(v, list) or not all(isinstance(x, _NUM) and not isinstance(x, bool) for x in v):
            raise _Bad(f"{where}.grad_sample[{n!r:.40}] is not a list of numbers")


@dataclass
class WatchedRun:
    path: Path
    manifest: dict
    steps: list[dict]
    source: object = field(repr=False)

    def __getitem__(self, key):
        return self.manifest[key]

    def snapshot(self, step: int) -> dict[str, np.ndarray] | None:
        """``{key: array}`` of the snapshot at ``step`` (None when not taken), each checked against its index."""
        e = next((s for s in self.manifest["snapshots"] if s["step"] == step), None)
        if e is None:
            return None
        stored = [a for a in e["arrays"] if "same_as" not in a]
        expected = {f"a{i:05d}": (a["key"], tuple(a["shape"]), a["dtype"]) for i, a in enumerate(stored)}
        limit = sum((nbytes_of(s, d) if d in STORAGE else 8 * math.prod(s)) + NPZ_SLACK
                    for _, s, d in expected.values()) + NPZ_SLACK
        try:
            data = self.source.read(e["file"], limit)
            if e.get("sha256") is not None and hashlib.sha256(data).hexdigest() != e["sha256"]:
                raise _Bad(f"{e['file']} is not the file the watch wrote (its SHA-256 differs from the manifest's): "
                           "it was changed after the run")
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                if set(z.files) != set(expected):
                    raise _Bad(f"{e['file']} holds other arrays than its index lists")
                out = {}
                for name, (key, shape, dtype) in expected.items():
                    a = z[name]
                    want = STORAGE.get(dtype) or EXACT_STORAGE[dtype]
                    if a.dtype != np.dtype(want) or tuple(a.shape) != shape:
                        raise _Bad(f"{e['file']}: {key} is {a.dtype}{list(a.shape)}, the index says "
                                   f"{want}{list(shape)}")
                    out[key] = a
                for a in e["arrays"]:  # a tensor seen twice at the same version: stored once
                    if "same_as" in a:
                        out[a["key"]] = out[a["same_as"]]
                return out
        except _Bad as exc:
            raise UsageError(f"watched run {self.path}: {exc}") from None
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, TypeError, SyntaxError,
                tokenize.TokenError, RecursionError, zlib.error) as exc:
            raise UsageError(f"watched run {self.path}: {e['file']} is not a plain array file "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def open_watched(path: str | os.PathLike) -> WatchedRun:
    """The watched run at ``path`` (folder or zip), manifest and every step checked."""
    path = Path(path)
    try:
        source = BundleFiles(path)
        manifest = _json(source.read(MANIFEST, MAX_MANIFEST_BYTES), MANIFEST)
        _check_manifest(manifest)
        check_fingerprint(manifest["fingerprint"])
        raw = source.read(STEPS, MAX_STEPS_BYTES)
        recorded = manifest.get("steps_sha256")  # older runs: none
        if recorded is not None and hashlib.sha256(raw).hexdigest() != sha_field(recorded, "steps_sha256"):
            raise _Bad(f"{STEPS} is not the file the watch wrote (its SHA-256 differs from the manifest's): "
                       "it was changed after the run")
        lines = raw.decode("utf-8", errors="strict").splitlines()
        if len(lines) != manifest["steps"]:
            raise _Bad(f"{STEPS} holds {len(lines)} steps, the manifest says {manifest['steps']}")
        steps = []
        for i, line in enumerate(lines):
            if len(line) > MAX_LINE_BYTES:
                raise _Bad(f"{STEPS} line {i + 1} is longer than a step's record ever is")
            steps.append(_check_step(_json(line.encode("utf-8"), f"{STEPS} line {i + 1}"), i))
    except UnicodeDecodeError:
        raise UsageError(f"watched run {path}: {STEPS} is not UTF-8 text") from None
    except _Bad as exc:
        raise UsageError(f"watched run {path}: {exc}") from None
    return WatchedRun(path, manifest, steps, source)


def _json(data: bytes, what: str):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _Bad(f"{what} is not JSON ({str(exc).splitlines()[0][:80]})") from None
