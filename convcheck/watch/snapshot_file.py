"""A snapshot step's ``.npz``: written off the training thread and hashed as it is written (issue 45).

``write_npz`` writes the arrays in the order given into a temporary file beside the target and renames it into
place when whole; a failure removes it (never a half-written snapshot). The archive is written in order
(``_Archive``, into a ``_Sink`` that cannot seek), each member's CRC and sizes following its data (a data descriptor)
instead of being patched into its header afterwards: every byte goes to the file once, and the SHA-256 of what was
written is the file's (``sha256sum`` agrees) - no second read of the file. ``np.load`` and ``runformat/reader.py`` read it as
any ``.npz`` (the sizes are in the central directory).

A large file (``DIRECT_FROM`` bytes of arrays or more) is written past the page cache where the file system takes
it (Linux, ``O_DIRECT``; ``_DirectSink``: through one page-aligned buffer of ``DIRECT_CHUNK`` bytes, the last block
padded and the file cut back to its length): a snapshot is read again only by a later ``diff``, and on the 2-core VM
this was measured on, a large new file's pages cost ~12 ms of kernel time per MB in the page cache (dd: 256 MB in
1.6-3.9 s buffered, 0.16-0.19 s with ``oflag=direct``; ``write_npz``: 267 MB in 3.4-3.7 s against 0.55-0.57 s,
100 MB 1.15-1.20 s against 0.22-0.24 s, but 50 MB 0.07 s against 0.12 s - a small file is quicker through the
cache, whose pages it finds at hand). A file system that refuses it (tmpfs, some FUSE or overlay mounts) gets the
same bytes through the page cache.

``Background``: one file written by a thread of its own while the user's loop goes on (the file write, ``zlib``'s
CRC and ``hashlib`` release the GIL); the watch (``recorder.py``) waits for it before another snapshot, before a
step's record that the snapshot's exact size decides against ``max_bytes``, when its recording stops and at the
block's end, so at most one written snapshot is held in memory and the index entry naming the file's bytes and
SHA-256 is whole before a manifest lists it. A failure there (disk full, a folder made read-only) is raised
again by ``wait`` in the training thread, where the watch says it as it would have at the step's end."""

from __future__ import annotations

import errno
import hashlib
import io
import mmap
import os
import sys
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np

try:
    import fcntl  # O_DIRECT set and cleared on an open file (Linux); imported here, never in the writer thread
except ImportError:  # Windows
    fcntl = None


ALIGN = 4096  # O_DIRECT's alignment of memory, offsets and lengths: a page, a multiple of every block size in use
DIRECT_CHUNK = 8 << 20  # the aligned buffer a direct write goes through
DIRECT_FROM = 64 << 20  # arrays of this many bytes or more are written past the page cache
REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}  # O_DIRECT not taken


class _Sink:
    """The file as ``_Archive`` writes it, in order: counted and hashed as it goes; ``seek`` refused (each member's
    sizes follow its data, in a data descriptor). Through the page cache."""

    def __init__(self, fd: int):
        self.f = os.fdopen(fd, "wb", closefd=False)
        self.sha, self.n = hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self._put(view)
        self.n += view.nbytes
        return view.nbytes

    def _put(self, view: memoryview) -> None:
        self.f.write(view)  # a large array from its own memory

    def tell(self) -> int:
        return self.n

    def seek(self, *args):
        raise io.UnsupportedOperation("a snapshot is written in order (its sizes follow each member's data)")

    def flush(self) -> None:
        pass  # written out whole by ``close``

    def close(self) -> None:
        """The rest written out (the archive whole)."""
        self.f.flush()

    def release(self) -> None:
        """Let go of the buffer (after ``close``, or after a failure: what it still holds is not written)."""
        try:
            self.f.close()
        except OSError:
            pass  # the failure at hand is the one said


class _DirectSink(_Sink):
    """The same bytes past the page cache (``O_DIRECT`` set on ``fd``): gathered in a page-aligned buffer written out
    ``DIRECT_CHUNK`` bytes at a time; the last piece padded to ``ALIGN`` and the file then cut back to its length."""

    def __init__(self, fd: int):
        self.fd, self.sha, self.n = fd, hashlib.sha256(), 0
        self.buffer = mmap.mmap(-1, DIRECT_CHUNK)  # anonymous: page-aligned
        self.view, self.used = memoryview(self.buffer), 0

    def _put(self, view: memoryview) -> None:
        i = 0
        while i < view.nbytes:
            take = min(DIRECT_CHUNK - self.used, view.nbytes - i)
            self.view[self.used:self.used + take] = view[i:i + take]
            self.used, i = self.used + take, i + take
            if self.used == DIRECT_CHUNK:
                self._out(DIRECT_CHUNK)

    def _out(self, size: int) -> None:
        done = 0
        while done < size:
            done += os.write(self.fd, self.view[done:size])
        self.used = 0

    def close(self) -> None:
        if self.used:
            padded = -(-self.used // ALIGN) * ALIGN
            self.view[self.used:padded] = bytes(padded - self.used)
            self._out(padded)
        os.ftruncate(self.fd, self.n)

    def release(self) -> None:
        if not self.buffer.closed:
            self.view.release()
            self.buffer.close()


def _direct(fd: int) -> bool:
    """``O_DIRECT`` set on ``fd``, where the platform and the file system take it."""
    if fcntl is None or not hasattr(os, "O_DIRECT"):
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True


def _zip(sink: _Sink, members: list[tuple[str, np.ndarray]]) -> tuple[int, str]:
    """``members`` as an uncompressed zip64 archive of ``.npy`` files, written to ``sink`` in order (``_Archive``)."""
    try:
        archive = _Archive(sink)
        for name, a in members:
            archive.add(name + ".npy", a)
        archive.end()
        sink.close()
    finally:
        sink.release()
    return sink.n, sink.sha.hexdigest()


SMALL_MEMBER = 1 << 16  # bytes: a member this small goes to the sink in one piece (one write, one hash update)


class _Archive:
    """An uncompressed zip64 archive written in order, as ``zipfile`` writes one to a stream it cannot seek (``STORED``,
    each member's CRC and sizes in a data descriptor after its data, zip64 fields throughout) - with the headers
    packed here, not by ``zipfile``'s per-member objects: a snapshot of a cell unrolled over time holds hundreds of
    small arrays, and ``zipfile``'s ~30 us of Python a member (``z.open``, eight writes) held the GIL against the
    training thread (516 members of 8 KB: 16 ms of CPU, now 9, most of it the CRC and SHA-256 with the GIL released).
    ``zipfile``, ``np.load`` and ``unzip`` read it (``test_watch_snapshot_write.py``)."""

    VERSION = 45  # zip64
    FLAGS = 0x08 | 0x800  # sizes in a data descriptor; the name in UTF-8

    def __init__(self, sink: _Sink):
        self.sink, self.central, self.headers = sink, [], {}
        t = time.localtime(time.time())
        self.dostime = t.tm_hour << 11 | t.tm_min << 5 | t.tm_sec // 2
        self.dosdate = max(t.tm_year - 1980, 0) << 9 | t.tm_mon << 5 | t.tm_mday

    def _npy_header(self, a: np.ndarray) -> bytes:
        key = (a.dtype.str, a.shape)
        got = self.headers.get(key)
        if got is None:
            buf = io.BytesIO()
            np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(a))
            got = self.headers[key] = buf.getvalue()
        return got

    def add(self, name: str, a: np.ndarray) -> None:
        raw = name.encode("utf-8")
        offset = self.sink.tell()
        local = struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", self.VERSION, 0, self.FLAGS, 0, self.dostime, self.dosdate,
                            0, 0xFFFFFFFF, 0xFFFFFFFF, len(raw), 20) + raw + struct.pack("<2H2Q", 1, 16, 0, 0)
        head = self._npy_header(a)
        data = memoryview(a.reshape(-1)).cast("B") if a.nbytes else memoryview(b"")
        crc = zlib.crc32(data, zlib.crc32(head))
        size = len(head) + data.nbytes
        tail = struct.pack("<LLQQ", 0x08074B50, crc, size, size)  # the data descriptor, zip64
        if data.nbytes < SMALL_MEMBER:
            self.sink.write(b"".join((local, head, data, tail)))
        else:
            self.sink.write(local + head)
            self.sink.write(data)
            self.sink.write(tail)
        self.central.append(struct.pack(
            "<4s4B4HL2L5H2L", b"PK\x01\x02", self.VERSION, 3, self.VERSION, 0, self.FLAGS, 0, self.dostime,
            self.dosdate, crc, 0xFFFFFFFF, 0xFFFFFFFF, len(raw), 28, 0, 0, 0, 0o600 << 16, 0xFFFFFFFF)
            + raw + struct.pack("<2H3Q", 1, 24, size, size, offset))

    def end(self) -> None:
        start = self.sink.tell()
        directory = b"".join(self.central)
        self.sink.write(directory)
        n, size, end64 = len(self.central), len(directory), self.sink.tell()
        self.sink.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, self.VERSION, self.VERSION, 0, 0, n, n, size,
                                    start)
                        + struct.pack("<4sLQL", b"PK\x06\x07", 0, end64, 1)
                        + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                                      min(size, 0xFFFFFFFF), min(start, 0xFFFFFFFF), 0))


def write_npz(path: Path, members: list[tuple[str, np.ndarray]]) -> tuple[int, str]:
    """``members`` (``(name, array)``, each array C-contiguous) as ``path``, an uncompressed ``.npz``; returns
    its size in bytes and its SHA-256, from the bytes as they were written."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:  # each array written from its own memory, renamed into place when whole
        try:
            if sum(a.nbytes for _, a in members) < DIRECT_FROM or not _direct(fd):
                got = _zip(_Sink(fd), members)
            else:
                try:
                    got = _zip(_DirectSink(fd), members)
                except OSError as exc:
                    if exc.errno not in REFUSED:
                        raise
                    # the file system took O_DIRECT but not its writes: the same bytes again, through the page cache
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                    got = _zip(_Sink(fd), members)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return got


class SnapshotWriteFailed(Exception):
    """A snapshot's write failed in the background: the error, and the step and place (``where``) whose end
    handed it over - the watch's ``fail`` says it as the step's end would have."""

    def __init__(self, error: BaseException, step: int, where: str):
        super().__init__(str(error))
        self.error, self.step, self.where = error, step, where


# a snapshot of fewer bytes is waited for at the end of its own step: its write is short, and alongside the loop it
# slowed it more than it took (char_gru, 3 MB: +34-39 ms a run written alongside, +23 ms waited for), while
# the step records behind it were held (a process killed then lost them)
BACKGROUND_FROM = 8 << 20
NICER = 10  # how much lower the writer thread's scheduling priority is than the training thread's


def _yield_cpu() -> None:
    """The calling thread made ``NICER`` nicer (Linux: a thread's own priority, ``setpriority`` on its id): where
    the cores are all busy - torch's threads, another process - the loop runs first and the snapshot is written in
    what time is left; on an idle core nothing changes. Elsewhere, or where it is refused, nothing is done."""
    native = getattr(threading, "get_native_id", None)
    if native is None or not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    try:
        tid = native()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICER))
    except OSError:
        pass


class Background:
    """``write()`` run by a thread of its own; ``wait`` joins it and gives its result or raises
    ``SnapshotWriteFailed``."""

    def __init__(self, write, step: int, where: str, bound: int):
        self.step, self.where, self.bound = step, where, bound  # bound: the most the file takes (``file_bound``)
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(write,), name=f"convcheck snapshot {step}")
        self.thread.start()

    def _run(self, write) -> None:
        _yield_cpu()
        try:
            self.result = write()
        except BaseException as exc:  # noqa: BLE001 - raised again in the training thread (``wait``)
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self):
        self.thread.join()
        if self.error is not None:
            raise SnapshotWriteFailed(self.error, self.step, self.where)
        return self.result
