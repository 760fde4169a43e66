"""Writing a bundle: arrays streamed to disk one at a time, the manifest last.

Every file goes through ``convcheck.files.atomic_write_bytes``; the output folder follows
``convcheck.report.folder``'s rules (never clobber without ``--force``, regular files only).
With ``zip_path`` the files are packed into one ``.zip`` at the end and the staging folder removed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from convcheck.runformat.schema import ARRAY_GROUPS, MANIFEST, SCHEMA, storage_dtype
from convcheck.errors import UsageError
from convcheck.files import atomic_write_bytes, path_kind, refuse_special


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def as_array(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """``(array as stored, the tensor's dtype name)``: float64 kept, other floats as float32 (exact)."""
    name = dtype_name(t)
    if name not in ("float64", "float32", "bfloat16", "float16"):
        raise UsageError(f"cannot record a {name} tensor (floating tensors only)")
    arr = t.detach().to("cpu", dtype=getattr(torch, storage_dtype(name))).contiguous().numpy()
    return arr, name


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


class BundleWriter:
    """Writes into ``folder`` (created by the caller); ``index`` becomes ``manifest["arrays"]``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.index: dict = {"forward": [], "grads": [], "snapshots": [], "parameters": []}
        for sub in ("forward", "grads", "snapshots"):
            (self.folder / sub).mkdir(exist_ok=True)

    def _write(self, rel: str, data: bytes) -> str:
        """Writes ``data`` to ``rel``; returns its SHA-256 (the index records it: the reader checks it)."""
        atomic_write_bytes(self.folder / rel, data)
        return hashlib.sha256(data).hexdigest()

    def forward(self, key: str, module: str, t: torch.Tensor) -> None:
        arr, dtype = as_array(t)
        rel = f"forward/{len(self.index['forward']):05d}.npz"
        sha = self._write(rel, npz_bytes({"a": arr}))
        self.index["forward"].append({"key": key, "module": module, "file": rel, "shape": list(arr.shape),
                                      "dtype": dtype, "sha256": sha})

    def grad(self, param: str, t: torch.Tensor) -> None:
        arr, dtype = as_array(t)
        rel = f"grads/{len(self.index['grads']):05d}.npz"
        sha = self._write(rel, npz_bytes({"a": arr}))
        self.index["grads"].append({"param": param, "file": rel, "shape": list(arr.shape), "dtype": dtype,
                                    "sha256": sha})

    def snapshot(self, step: int, named_params: list[tuple[str, torch.Tensor]]) -> None:
        if not self.index["parameters"]:
            self.index["parameters"] = [{"name": n, "shape": list(p.shape), "dtype": dtype_name(p)}
                                        for n, p in named_params]
        arrays = {f"p{i:05d}": as_array(p)[0] for i, (_, p) in enumerate(named_params)}
        rel = f"snapshots/step_{step:05d}.npz"
        sha = self._write(rel, npz_bytes(arrays))
        self.index["snapshots"].append({"step": step, "file": rel, "sha256": sha})

    def finish(self, manifest: dict) -> None:
        manifest.update(schema=SCHEMA, arrays=self.index)
        self._write(MANIFEST, json.dumps(manifest, indent=1, sort_keys=False).encode("utf-8"))


def prepare_folder(out: Path, force: bool) -> tuple[Path, list[Path]]:
    """The folder to write the bundle into and the folders this run created (to remove on failure): ``out``
    made if missing, used if empty, or (``force``) an earlier bundle's array files removed; anything
    else there (another file, a link, a folder of something else) is a one-line ``UsageError``."""
    kind = path_kind(out)
    if kind is None:
        out.mkdir(parents=True)
        return out, [out]
    if kind != "directory":
        raise UsageError(f"--out {out}: exists and is a {kind}, not a bundle folder")
    entries = sorted(os.listdir(out))
    if not entries:
        return out, []
    if MANIFEST not in entries or not force:
        raise UsageError(f"--out {out} is not empty" + ("; pass --force to replace the bundle there"
                                                         if MANIFEST in entries else ""))
    unknown = [e for e in entries if e not in (*ARRAY_GROUPS, MANIFEST)]
    if unknown:
        raise UsageError(f"--out {out} holds {unknown[0]!r}, which is not part of a bundle; refusing to replace it")
    for sub in ARRAY_GROUPS:
        d = out / sub
        if path_kind(d) == "directory":
            for name in os.listdir(d):
                if path_kind(d / name) != "file":
                    raise UsageError(f"--out {d / name} is not a regular file; refusing to replace it")
                (d / name).unlink()
        elif path_kind(d) is not None:
            raise UsageError(f"--out {d} is not a directory; refusing to replace it")
    return out, []


def staging_folder(zip_path: Path) -> Path:
    """A fresh folder beside the zip to write into before packing."""
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{zip_path.name}.", dir=zip_path.parent))


def pack_zip(folder: Path, zip_path: Path, *, force: bool) -> Path:
    """The folder's files packed into ``zip_path`` (atomically), the folder removed."""
    refuse_special(zip_path)
    if os.path.lexists(zip_path) and not force:
        raise UsageError(f"{zip_path} exists; pass --force to replace it")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                z.write(path, path.relative_to(folder).as_posix())
    atomic_write_bytes(zip_path, buf.getvalue())
    shutil.rmtree(folder)
    return zip_path
