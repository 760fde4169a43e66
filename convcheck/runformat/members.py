"""A recorded run's members read without trusting them: a folder or a ``.zip`` whose every member is a regular
file named by a relative path without ``..`` (symbolic links, devices, FIFOs, absolute names refused), each
read with a size limit (``BundleFiles``)."""

from __future__ import annotations

import os
import stat
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from convcheck.runformat.fields import BadField
from convcheck.runformat.schema import MAX_MEMBERS


def safe_member(name: str) -> str:
    p = PurePosixPath(name)
    if not name or name.startswith(("/", "\\")) or p.is_absolute() or ".." in p.parts or "\\" in name \
            or (len(name) > 1 and name[1] == ":"):
        raise BadField(f"member {name!r} is not a plain relative path")
    return name


class BundleFiles:
    """The bundle's files, from a folder or a zip; ``read(name, limit)`` returns bytes."""

    def __init__(self, path: Path):
        self.path = path
        st = _lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise BadField("is a symbolic link; pass the bundle itself")
        if stat.S_ISDIR(st.st_mode):
            self.zip = None
        elif stat.S_ISREG(st.st_mode):
            try:
                self.zip = zipfile.ZipFile(path)
                infos = self.zip.infolist()
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                raise BadField(f"not a readable bundle zip ({exc})") from None
            if len(infos) > MAX_MEMBERS:
                raise BadField(f"holds {len(infos)} members, more than a bundle ever has")
            self.members = {}
            for info in infos:
                name = safe_member(info.filename)
                if info.is_dir():
                    continue
                if stat.S_ISLNK(info.external_attr >> 16):
                    raise BadField(f"member {name!r} is a symbolic link")
                self.members[name] = info
        else:
            raise BadField("is neither a folder nor a .zip file")

    def read(self, name: str, limit: int) -> bytes:
        safe_member(name)
        if self.zip is not None:
            info = self.members.get(name)
            if info is None:
                raise BadField(f"{name} is missing")
            if info.file_size > limit:
                raise BadField(f"{name} claims {info.file_size} bytes, more than the {limit} it may hold")
            try:
                with self.zip.open(info) as f:
                    data = f.read(limit + 1)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, zlib.error) as exc:
                raise BadField(f"{name} cannot be read ({exc})") from None
        else:
            full = self.path
            for part in PurePosixPath(name).parts:  # no link anywhere on the way
                full = full / part
                st = _lstat(full, name)
                if stat.S_ISLNK(st.st_mode):
                    raise BadField(f"{name} is (or passes through) a symbolic link")
            if not stat.S_ISREG(st.st_mode):
                raise BadField(f"{name} is not a regular file")
            if st.st_size > limit:
                raise BadField(f"{name} is {st.st_size} bytes, more than the {limit} it may hold")
            try:
                with open(full, "rb") as f:
                    data = f.read(limit + 1)
            except OSError as exc:
                raise BadField(f"{name} cannot be read ({exc.strerror or exc})") from None
        if len(data) > limit:
            raise BadField(f"{name} is larger than the {limit} bytes it may hold")
        return data


def _lstat(path: Path, name: str | None = None):
    try:
        return os.lstat(path)
    except OSError as exc:
        raise BadField(f"{name + ' ' if name else ''}cannot be opened ({exc.strerror or exc})") from None
