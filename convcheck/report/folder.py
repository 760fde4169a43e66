"""The run folder ``convcheck compare`` writes: chosen safely, never clobbered, cleaned up when unused.

- ``--out DIR``: checked (and created) before the run, so a bad path fails
  before any work. A folder that already holds a report file is refused
  unless ``--force``; with it, the earlier report's files that the new run
  does not write again (a stopped run's plots, say) are removed when it writes
  (``export.remove_stale``), so the folder never mixes two runs. Other files in
  it are never touched. A report file that is a link, a device or a FIFO is
  refused even with ``--force``.
- The default, ``reports/<UTC time to the millisecond>-<model>``, is created
  only when there is something to write, with an exclusive ``mkdir``: a second
  run in the same millisecond gets ``-2``, ``-3``..., never the same folder.
- A failed run removes the folders it created and left empty.
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime, timezone
from pathlib import Path

from convcheck.errors import UsageError
from convcheck.files import path_kind, refuse_linked_folder, refuse_special

REPORT_FILES = ("summary.json", "layers.csv", "curves.csv", "env.json", "loss.png", "layers.png", "verify.png",
                "report.html")
_ATTEMPTS = 1000


def safe_name(text: str) -> str:
    """A model spec as a folder-name part: ``./nets.py:build`` -> ``nets.py_build``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text.replace("\\", "/").rsplit("/", 1)[-1])[:40].strip(".") or "model"


def default_folder_name(model: str, now: float | None = None) -> str:
    stamp = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc)
    return f"{stamp:%Y%m%dT%H%M%S}.{stamp.microsecond // 1000:03d}Z-{safe_name(model)}"


def check_report_files(path: Path, *, force: bool, files: tuple[str, ...] = REPORT_FILES) -> None:
    """Report files (``files``) already in ``path``: refused without ``force``; only regular files may be replaced."""
    present = [name for name in files if os.path.lexists(path / name)]
    for name in present:
        refuse_special(path / name, "--out")
    if present and not force:
        raise UsageError(f"--out {path} already holds a report ({', '.join(present)}); pass --force to overwrite "
                         "it or choose another folder")


class RunFolder:
    """Where a run's files go. ``path`` is None until a default folder is created."""

    def __init__(self, path: Path | None, *, force: bool = False, model: str = "model",
                 base: Path = Path("reports")):
        self.path = path
        self.force = force
        self.model = model
        self.base = base
        self.created: list[Path] = []  # folders this run made, outermost first

    @classmethod
    def explicit(cls, out: str | os.PathLike, *, force: bool, files: tuple[str, ...] = REPORT_FILES) -> "RunFolder":
        """``--out DIR``: a directory (not a link to one: ``files.refuse_linked_folder``) or nothing yet; created
        now, report files (``files``: those the command writes) checked."""
        folder = cls(Path(out), force=force)
        refuse_linked_folder(folder.path, "--out ")  # one policy with convcheck.watch(out=): no linked folder
        kind = path_kind(folder.path)
        if kind not in (None, "directory"):
            raise UsageError(f"--out {folder.path}: exists and is not a directory (it is a {kind})")
        if kind is None:
            folder._make(folder.path)
        check_report_files(folder.path, force=force, files=files)
        return folder

    @classmethod
    def default(cls, model: str, *, base: str | os.PathLike = "reports") -> "RunFolder":
        return cls(None, model=model, base=Path(base))

    def ensure(self) -> Path:
        """The folder, created now if it is the default one: a fresh, unique directory."""
        if self.path is not None:
            return self.path
        kind = path_kind(self.base)
        if kind not in (None, "directory") and not self.base.is_dir():
            raise UsageError(f"cannot write reports: {self.base} is a {kind}, not a directory (use --out DIR)")
        if kind is None:
            self._make(self.base)
        name = default_folder_name(self.model)
        for n in range(1, _ATTEMPTS + 1):
            candidate = self.base / (name if n == 1 else f"{name}-{n}")
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise UsageError(f"cannot create {candidate}: {exc.strerror or exc}") from None
            self.created.append(candidate)
            self.path = candidate
            return candidate
        raise UsageError(f"cannot create a new folder under {self.base}: {_ATTEMPTS} names taken")

    def _make(self, path: Path) -> None:
        missing = []
        p = path
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out {path}: cannot create directory ({exc.strerror or exc})") from None
        self.created += list(reversed(missing))

    def discard_if_empty(self) -> None:
        """Remove the folders this run created, innermost first, while they are empty."""
        for p in reversed(self.created):
            try:
                p.rmdir()
            except OSError:
                break
        self.created = []
