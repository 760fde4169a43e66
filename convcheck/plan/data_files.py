"""MNIST IDX files and ``.npz`` arrays, read with checks and size limits (the built-in file sources).

Every failure the user can fix is a one-line ``UsageError`` naming the file.
"""

from __future__ import annotations

import gzip
import math
import os
import zipfile
import zlib
from typing import Optional

import numpy as np

from convcheck.errors import UsageError
from convcheck.files import array_load_error

_IMAGES_MAGIC = 2051
_LABELS_MAGIC = 2049
# The most an IDX file (or a gzip member's content) may hold: EMNIST's largest file is 0.55 GiB.
MAX_IDX_BYTES = 1 << 30


def _find(directory: str, kind: str, what: str, magic_dims: str) -> Optional[str]:
    for sep in ("-", "."):
        for ext in ("", ".gz"):
            path = os.path.join(directory, f"{kind}-{what}{sep}{magic_dims}-ubyte{ext}")
            if os.path.isfile(path):
                return path
    return None


def read_mnist(directory: str, input_shape) -> tuple[np.ndarray, np.ndarray, str]:
    if input_shape != (1, 28, 28):
        raise UsageError(
            f"MNIST images are 1x28x28 but the model expects {'x'.join(map(str, input_shape))}"
        )
    if not os.path.isdir(directory):
        raise UsageError(f"MNIST directory {directory} does not exist")
    for kind in ("train", "t10k"):
        images = _find(directory, kind, "images", "idx3")
        labels = _find(directory, kind, "labels", "idx1")
        if images and not labels:
            raise UsageError(f"{images} has no labels file: expected {kind}-labels-idx1-ubyte[.gz] beside it")
        if labels and not images:
            raise UsageError(f"{labels} has no images file: expected {kind}-images-idx3-ubyte[.gz] beside it")
        if images and labels:
            x = _read_idx(images, _IMAGES_MAGIC)
            y = _read_idx(labels, _LABELS_MAGIC)
            if x.shape[1:] != (28, 28):
                raise UsageError(f"{images}: images are {x.shape[1]}x{x.shape[2]}, MNIST needs 28x28")
            if len(x) != len(y):
                raise UsageError(
                    f"{images} holds {len(x)} images but {labels} holds {len(y)} labels"
                )
            if len(x) == 0:
                raise UsageError(f"{images} holds no images")
            return x[:, None], y, images
    raise UsageError(
        f"no MNIST files in {directory}: expected train-images-idx3-ubyte and "
        "train-labels-idx1-ubyte (or t10k-*, optionally .gz)"
    )


def _read_idx(path: str, magic: int) -> np.ndarray:
    """Read an unsigned-byte IDX file (images: magic 2051, 3 dims; labels: 2049, 1 dim).

    The header is read first; at most what it describes (plus one byte, to notice
    more) is then read or decompressed, and never more than ``MAX_IDX_BYTES``: a
    small gzip that expands to gigabytes ends in a one-line error, not in memory.
    """
    ndim = magic - 2048
    header = 4 + 4 * ndim
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            data = f.read(header)
            if len(data) < header:
                raise UsageError(f"{path}: truncated, only {len(data)} bytes (header needs {header})")
            found = int.from_bytes(data[:4], "big")
            if found != magic:
                raise UsageError(
                    f"{path}: bad magic number {found}, expected {magic} "
                    f"({'images' if magic == _IMAGES_MAGIC else 'labels'} IDX file)"
                )
            dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
            expected = header + math.prod(dims)
            if expected > MAX_IDX_BYTES:
                raise UsageError(f"{path}: its header ({'x'.join(map(str, dims))}) describes {expected} bytes, "
                                 f"more than the {MAX_IDX_BYTES >> 30} GiB convcheck reads")
            data += f.read(expected - header + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise UsageError(f"{path}: cannot read ({e})") from None
    if len(data) < expected:
        raise UsageError(
            f"{path}: truncated, {len(data)} bytes but its header ({'x'.join(map(str, dims))}) "
            f"needs {expected}"
        )
    if len(data) > expected:
        raise UsageError(
            f"{path}: {len(data) - expected} bytes beyond what its header "
            f"({'x'.join(map(str, dims))}) describes"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _check_npz_sizes(path: str) -> None:
    """What the archive's members expand to, read from the zip directory before anything is decompressed:
    a small .npz that would expand past ``MAX_IDX_BYTES`` is refused in one line, not loaded."""
    try:
        with zipfile.ZipFile(path) as z:
            total = sum(info.file_size for info in z.infolist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return  # not a zip (a plain .npy, or damaged): np.load says what it is
    if total > MAX_IDX_BYTES:
        raise UsageError(f"{path}: its arrays would expand to {total / 2**30:.1f} GiB, more than the "
                         f"{MAX_IDX_BYTES / 2**30:.0f} GiB convcheck reads")


def npz_input_shape(path: str) -> tuple[int, int, int] | None:
    """The ``(C, H, W)`` of one sample of the archive's ``x``, read from its member's header alone
    (nothing decompressed past it): ``x`` of shape (N, C, H, W), or (N, H, W) as one channel. None where
    that cannot be told (no such file or member, another layout, an unreadable header): ``read_npz``
    then says what is wrong in one line. Only a regular file is opened (``/dev/zero`` would be read forever)."""
    if not os.path.isfile(path) or _special(path):
        return None
    try:
        with zipfile.ZipFile(path) as z, z.open("x.npy") as f:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read:
                return None
            shape = read[version](f)[0]
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    dims = tuple(int(d) for d in shape[1:])
    if len(dims) == 2:
        dims = (1,) + dims
    return dims if len(dims) == 3 and min(dims) >= 1 else None


def _special(path: str) -> str | None:
    """What is at ``path`` when it is a device, FIFO or socket (a link followed), else None."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


def read_npz(path: str, input_shape) -> tuple[np.ndarray, np.ndarray, str]:
    special = _special(path)
    if special:
        raise UsageError(f"npz file {path} is {special}, not a regular file")
    if not os.path.isfile(path):
        raise UsageError(f"npz file {path} does not exist")
    _check_npz_sizes(path)
    try:
        f = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise UsageError(f"{path}: cannot read as .npz ({array_load_error(e)})") from None
    if not isinstance(f, np.lib.npyio.NpzFile):
        raise UsageError(f"{path}: a single array, not an .npz archive with arrays 'x' and 'y'")
    with f:
        missing = [k for k in ("x", "y") if k not in f.files]
        if missing:
            raise UsageError(
                f"{path}: no array {' or '.join(repr(m) for m in missing)} "
                f"(found: {', '.join(f.files) or 'none'})"
            )
        try:
            x, y = f["x"], f["y"]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise UsageError(f"{path}: cannot read arrays x and y ({array_load_error(e)})") from None
    if x.dtype.kind not in "fiub":
        raise UsageError(f"{path}: x has dtype {x.dtype}, expected numbers")
    if x.ndim == 3 and input_shape[0] == 1:
        x = x[:, None]
    if x.ndim != 4 or tuple(x.shape[1:]) != input_shape:
        c, h, w = input_shape
        hint = (f" (channels last: save x.transpose(0, 3, 1, 2))" if x.ndim == 4 and tuple(x.shape[1:]) == (h, w, c)
                else "")
        raise UsageError(
            f"{path}: x has shape {x.shape}, expected (N, {', '.join(map(str, input_shape))}){hint}"
        )
    if len(x) == 0:
        raise UsageError(f"{path}: x holds no samples")
    if not np.isfinite(x).all():
        raise UsageError(f"{path}: x contains NaN or infinite values")
    if y.ndim != 1 or len(y) != len(x):
        raise UsageError(f"{path}: y has shape {y.shape}, expected ({len(x)},) to match x")
    if y.dtype.kind not in "iu":
        raise UsageError(f"{path}: y has dtype {y.dtype}, expected integer class labels")
    return x, y, path
