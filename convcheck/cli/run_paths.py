"""What ``convcheck diff`` checks of the paths it is given, shared by its recorded and watched halves
(``diff.py``, ``diff_watched.py``): a path that is no run said in one line, and an ``--out`` folder that goes
again when the run it was made for is refused."""

from __future__ import annotations


_REPORTS = ("summary.json", "watch_diff.json", "watch_judge.json")


def not_a_run(path, *, strict: bool = True) -> str | None:
    """What is wrong with ``path`` as a run to diff (its manifest names no run's schema), in one line: missing, a
    plain file, a report folder, a folder without a manifest. ``strict=False`` (neither side watched: the
    bundle reader says the rest, "not a readable bundle zip", "manifest.json cannot be opened"): only a missing
    path, a device or FIFO, and a report folder."""
    import os
    import stat
    from pathlib import Path

    runs = "diff reads what convcheck.watch or convcheck record wrote"
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return f"diff: {path}: no such folder"
    except OSError as exc:
        return f"diff: {path}: cannot be read ({exc.strerror or exc})"
    p = Path(path)
    if stat.S_ISREG(mode):
        if not strict:  # the bundle reader: "not a readable bundle zip"
            return None
        return f"diff: {path}: not a watched run or a recorded bundle ({runs})"
    if not stat.S_ISDIR(mode):
        return f"diff: {path}: not a watched run or a recorded bundle (it is not a folder or a file; {runs})"
    has_manifest = os.path.lexists(p / "manifest.json")
    if not has_manifest and any(os.path.lexists(p / r) for r in _REPORTS):
        return f"diff: {path}: a report folder (what compare or diff wrote), not a run; {runs}"
    if not strict:
        return None
    if not has_manifest:
        return f"diff: {path}: not a watched run or a recorded bundle (no manifest.json in it; {runs})"
    return f"diff: {path}: not a watched run or a recorded bundle (its manifest.json is not a convcheck run's)"


class removed_if_empty:
    """Around a diff that made its ``--out`` folder: an error removes the folder again while it is empty."""

    def __init__(self, folder):
        self.folder = folder

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and self.folder is not None:
            self.folder.discard_if_empty()
        return False
