"""The one atomic file writer (a temporary file beside the target, then a rename), and the checks
that keep it from destroying anything.

A reader never sees a half-written file, and a failed write leaves no temporary
file behind. convcheck writes only regular files: a path that is a symbolic
link, a device node, a FIFO, a socket or a folder is refused with a one-line
``UsageError`` before anything is written, because a rename would replace it
(as root, ``/dev/full`` would become a regular file). Imports nothing from
convcheck but its errors, so ``convcheck.env`` and ``convcheck.report`` can both use it.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from convcheck.errors import RunFailed, UsageError

_KINDS = ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISSOCK, "socket"))
DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def path_kind(path: str | os.PathLike) -> str | None:
    """None when nothing is at ``path``; "file" for a regular file; else what is there (not following links)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise UsageError(f"cannot write {path}: a part of the path above it is a file, not a directory") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot check it ({exc.strerror or exc})") from None
    if stat.S_ISREG(mode):
        return "file"
    return next((name for test, name in _KINDS if test(mode)), "special file")


def refuse_linked_folder(path: str | os.PathLike, what: str) -> None:
    """One policy for every folder convcheck writes into - ``compare --out``, ``diff --out``, ``record --out``,
    ``convcheck.watch(out=)`` (issue 47): a symbolic link there is refused, never written through (it may lead into
    a run, another report or anywhere else); the user names the folder itself. Links above it are the user's
    own layout and followed."""
    if path_kind(path) == "symbolic link" and os.path.isdir(path):  # a link to anything else: not a folder at all
        target = os.path.realpath(path)
        raise UsageError(f"{what}{path} is a symbolic link (to {target}); convcheck writes into no linked folder: "
                         "name the folder itself")


def refuse_special(path: str | os.PathLike, what: str = "") -> bool:
    """``UsageError`` unless ``path`` is absent or a regular file; True when a regular file is there."""
    kind = path_kind(path)
    if kind in (None, "file"):
        return kind == "file"
    label = f"{what} {path}" if what else str(path)
    advice = "name a file inside it" if kind == "directory" else "remove it or choose another path"
    raise UsageError(f"{label} is a {kind}; convcheck writes only regular files and never replaces a {kind} "
                     f"({advice})")


def check_writable_file(path: str | os.PathLike, *, force: bool, what: str) -> Path:
    """A path convcheck may write: absent, or a regular file and ``force``; its folder a directory or absent."""
    text = os.fspath(path)
    path = Path(path)
    if text.endswith(("/", os.sep)) or path.name in ("", ".", ".."):
        raise UsageError(f"{what} {text}: name a file, not a directory")
    if refuse_special(path, what) and not force:
        raise UsageError(f"{what} {path}: the file exists; pass --force to overwrite it")
    parent = path.parent
    while str(parent) not in ("", ".") and not os.path.lexists(parent):
        parent = parent.parent
    if str(parent) not in ("", ".") and not parent.is_dir():
        raise UsageError(f"{what} {path}: {parent} is not a directory")
    return path


def write_error(exc: OSError, path: str | os.PathLike) -> Exception:
    """The one-line error for a failed write: a full disk is the machine's limit (exit 3), the rest bad input."""
    reason = exc.strerror or str(exc)
    if exc.errno in DISK_FULL:
        return RunFailed(f"disk full writing {path} ({reason})")
    return UsageError(f"cannot write {path}: {reason}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place.

    The file gets the mode a plain ``open(path, "w")`` would (0o666 less the
    umask), not the 0o600 of a temporary file. Anything but a regular file at
    ``path`` is refused (``UsageError``); write errors (``OSError``) propagate.
    """
    path = Path(path)
    refuse_special(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """``atomic_write_bytes`` of ``text`` encoded as UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def read_limited(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """At most ``limit`` bytes of ``path`` (a ``UsageError`` beyond that), read without loading more.

    A FIFO with no writer reads as empty instead of blocking; ``/dev/zero`` ends at the limit.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = None
            data = f.read(limit + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        if fd is not None:
            os.close(fd)
    if len(data) > limit:
        raise UsageError(f"{what} {path} is larger than {limit // 1024} KiB, more than such a file ever holds; "
                         "refusing to read it")
    return data


def array_load_error(exc: BaseException) -> str:
    """What numpy's failure to load an array file says, in words that do not invite the unsafe fix: numpy
    takes any file that is not an array for pickled data and suggests ``allow_pickle=True``, which would
    run code from the file. convcheck never loads pickles."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "allow_pickle" in text or "pickled" in text:
        return "not an array file numpy can read without running code from it (numpy took it for pickled " \
               "data, which convcheck never loads)"
    return text
