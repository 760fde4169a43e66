"""A snapshot step's file is written off the training thread and hashed as it is written (issue 45: a watched
snapshot step at most 1.5x a bare step): the loop goes on while it is written, the index names the file's own
SHA-256 and size without reading it back, the arrays are the ones the step saw, the block's end waits for it, and a
write that fails says so exactly as a write failing at the step's end did."""

from __future__ import annotations

import builtins
import contextlib
import copy
import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck
from convcheck.runformat.reader import open_watched

TIMEOUT = 5.0  # the most a planted wait holds the writer (before the change: the training thread itself)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def _train(out=None, steps=5, explicit=True, raise_at=None, during=None, **kw):
    """The loop the tests watch: SGD on fixed batches; ``during(step, w)`` runs before each step's forward;
    ``raise_at``: the loop's own ValueError at that step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    with (convcheck.watch(model, opt, out=out, **kw) if out else contextlib.nullcontext()) as w:
        for i in range(steps):
            if during is not None:
                during(i, w)
            if i == raise_at:
                raise ValueError("the loop's own error")
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if w is not None and explicit:
                w.step(loss)
    return losses


def _leftovers(run) -> list[str]:
    """Temporary files left in the run's snapshots folder."""
    return [f for f in os.listdir(run / "snapshots") if f.endswith(".tmp")]


def _hold_the_writer(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The snapshot's first array header waits for ``release`` (at most ``TIMEOUT``), ``started`` set as it does; every
    snapshot written in the background, however small (``recorder.BACKGROUND_FROM``)."""
    from convcheck.watch import recorder

    monkeypatch.setattr(recorder, "BACKGROUND_FROM", 0)
    started, release = threading.Event(), threading.Event()
    original = np.lib.format.write_array_header_1_0

    def held(*args, **kwargs):
        if not started.is_set():
            started.set()
            release.wait(TIMEOUT)
        return original(*args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array_header_1_0", held)
    return started, release


# --- the file and its index ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False], ids=["past the page cache", "through it"])
def test_the_index_names_the_files_own_sha256_and_size(tmp_path, monkeypatch, direct):
    from convcheck.watch import snapshot_file

    monkeypatch.setattr(snapshot_file, "DIRECT_FROM", 0 if direct else 1 << 62)
    _train(tmp_path / "run", snapshot_steps=(0, 1, 3))
    run = open_watched(tmp_path / "run")
    assert [e["step"] for e in run["snapshots"]] == [0, 1, 3]
    for e in run["snapshots"]:
        path = tmp_path / "run" / e["file"]
        out = subprocess.run(["sha256sum", str(path)], capture_output=True, text=True, check=True).stdout
        assert out.split()[0] == e["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert e["bytes"] == path.stat().st_size
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None  # every member's CRC right
            assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
        assert run.snapshot(e["step"]) is not None  # the reader checks the SHA-256 and every array
    assert _leftovers(tmp_path / "run") == []


def test_the_file_is_hashed_as_it_is_written_never_read_back(tmp_path, monkeypatch):
    reads = []
    original = builtins.open

    def watched_open(file, mode="r", *args, **kwargs):
        if "r" in mode and str(file).endswith(".npz"):
            reads.append(str(file))
        return original(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watched_open)
    _train(tmp_path / "run", snapshot_steps=(0, 2))
    monkeypatch.undo()
    assert reads == []
    assert len(open_watched(tmp_path / "run")["snapshots"]) == 2


def test_the_arrays_read_back_are_the_ones_the_step_saw(tmp_path):
    """``np.load`` of the file itself: each array bit for bit the parameters, gradients and layer inputs/outputs of
    step 0, taken here with hooks of the test's own."""
    torch.manual_seed(0)
    model = Net()
    initial = copy.deepcopy(model.state_dict())
    seen = {}
    handles = [m.register_forward_hook(lambda m, a, o, name=name: seen.update(
        {f"in/{name}/0/0": a[0].detach().clone(), f"out/{name}/0/0": o.detach().clone()}) if name not in
        {k.split("/")[1] for k in seen} else None) for name, m in model.named_children()]
    grads = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=tmp_path / "run", snapshot_steps=(0,)) as w:
        for i in range(3):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if i == 0:
                grads = {f"grad/{n}": p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            w.step(loss)
    for h in handles:
        h.remove()
    expected = {**{f"param/{n}": t for n, t in initial.items()}, **grads, **seen}
    entry = open_watched(tmp_path / "run")["snapshots"][0]
    stored = [a for a in entry["arrays"] if "same_as" not in a]
    member = {a["key"]: f"a{i:05d}" for i, a in enumerate(stored)}
    with np.load(tmp_path / "run" / entry["file"], allow_pickle=False) as z:
        assert sorted(z.files) == sorted(member.values())
        for a in entry["arrays"]:
            got = z[member[a.get("same_as", a["key"])]]
            want = expected[a["key"]].numpy()
            assert got.dtype == want.dtype == np.float32 and got.shape == want.shape, a["key"]
            assert got.tobytes() == want.tobytes(), a["key"]
    assert set(expected) == {a["key"] for a in entry["arrays"]}


def test_npz_written_in_order_reads_back_every_kind_of_array(tmp_path):
    from convcheck.watch.snapshot_file import write_npz

    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.float64(np.pi) * np.ones(()), np.zeros((0, 5)),
              np.arange(7, dtype=np.int64), np.array([True, False]), np.full((2, 3, 4), -0.0, dtype=np.float32)]
    members = [(f"a{i:05d}", a) for i, a in enumerate(arrays)]
    n, sha = write_npz(tmp_path / "x.npz", members)
    data = (tmp_path / "x.npz").read_bytes()
    assert n == len(data) and sha == hashlib.sha256(data).hexdigest()
    with np.load(tmp_path / "x.npz", allow_pickle=False) as z:
        for name, a in members:
            assert z[name].dtype == a.dtype and z[name].shape == a.shape and z[name].tobytes() == a.tobytes()
    assert os.listdir(tmp_path) == ["x.npz"]


def _members():
    return [(f"a{i:05d}", a) for i, a in enumerate([np.arange(3 * 4096 + 5, dtype=np.float32), np.ones((2, 3)),
                                                    np.arange(5, dtype=np.int64)])]


def _same(path, members) -> None:
    data = path.read_bytes()
    with np.load(path, allow_pickle=False) as z:
        assert all(z[name].tobytes() == a.tobytes() and z[name].dtype == a.dtype for name, a in members)
    assert sorted(os.listdir(path.parent)) == [path.name]
    return len(data), hashlib.sha256(data).hexdigest()


def test_the_file_is_the_same_through_the_page_cache_or_past_it(tmp_path, monkeypatch):
    """Past the page cache (O_DIRECT, where the file system takes it) or through it, the same archive: its arrays,
    its length and SHA-256 as written; a file system that takes O_DIRECT but refuses its writes gets it through
    the page cache."""
    from convcheck.watch import snapshot_file

    monkeypatch.setattr(snapshot_file, "DIRECT_CHUNK", 2 * snapshot_file.ALIGN)  # several chunks and a padded end
    monkeypatch.setattr(snapshot_file, "DIRECT_FROM", 0)  # past the page cache however small
    members = _members()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    assert snapshot_file.write_npz(tmp_path / "a" / "x.npz", members) == _same(tmp_path / "a" / "x.npz", members)
    monkeypatch.setattr(snapshot_file, "_direct", lambda fd: False)
    assert snapshot_file.write_npz(tmp_path / "b" / "x.npz", members) == _same(tmp_path / "b" / "x.npz", members)

    def refused(self, size):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(snapshot_file, "_direct", lambda fd: True)
    monkeypatch.setattr(snapshot_file._DirectSink, "_out", refused)
    assert snapshot_file.write_npz(tmp_path / "c" / "x.npz", members) == _same(tmp_path / "c" / "x.npz", members)


def test_a_full_disk_past_the_page_cache_is_raised_and_leaves_nothing(tmp_path, monkeypatch):
    from convcheck.watch import snapshot_file

    def full(self, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot_file, "DIRECT_FROM", 0)
    monkeypatch.setattr(snapshot_file, "_direct", lambda fd: True)
    monkeypatch.setattr(snapshot_file._DirectSink, "_out", full)
    with pytest.raises(OSError) as raised:
        snapshot_file.write_npz(tmp_path / "x.npz", _members())
    assert raised.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []


# --- off the training thread ---------------------------------------------------------------------------------------
def test_the_loop_goes_on_while_the_snapshot_is_written_and_the_blocks_end_waits_for_it(tmp_path, monkeypatch):
    started, release = _hold_the_writer(monkeypatch)
    path = tmp_path / "run" / "snapshots" / "step_00000.npz"
    during_write = []

    def during(i, w):
        if i == 1:
            assert started.wait(TIMEOUT)  # the writer began (in the training thread, before the change)
        if i >= 1:
            during_write.append(path.exists())
        if i == 4:  # the write let go only as the block ends: its end waits for it
            threading.Timer(0.3, release.set).start()

    bare = _train()
    assert _train(tmp_path / "run", during=during, snapshot_steps=(0,)) == bare
    assert during_write == [False, False, False, False]  # steps 1-4 ran while step 0's file was being written
    run = open_watched(tmp_path / "run")
    (entry,) = run["snapshots"]
    assert run["steps"] == 5 and [s["step"] for s in run.steps] == [0, 1, 2, 3, 4] and run["watch_error"] is None
    assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and entry["bytes"] == path.stat().st_size
    assert run.snapshot(0) is not None and _leftovers(tmp_path / "run") == []


def test_a_loop_that_raises_inside_the_block_leaves_the_snapshot_whole_and_no_temp_file(tmp_path, monkeypatch):
    started, release = _hold_the_writer(monkeypatch)

    def during(i, w):
        if i == 2:
            threading.Timer(0.3, release.set).start()

    with pytest.raises(ValueError, match="the loop's own error"):
        _train(tmp_path / "run", raise_at=2, during=during, snapshot_steps=(0,))
    run = open_watched(tmp_path / "run")
    assert run["stopped"]["exception"] == "ValueError" and run["stopped"]["step"] == 2
    assert run["steps"] == 2 and [e["step"] for e in run["snapshots"]] == [0]
    assert run.snapshot(0) is not None and _leftovers(tmp_path / "run") == []


def test_consecutive_snapshot_steps_are_each_written_whole_in_order(tmp_path):
    _train(tmp_path / "run", steps=4, snapshot_steps=(0, 1, 2, 3))
    run = open_watched(tmp_path / "run")
    assert [e["step"] for e in run["snapshots"]] == [0, 1, 2, 3] and run["steps"] == 4
    assert all(run.snapshot(s) is not None for s in range(4)) and _leftovers(tmp_path / "run") == []


def test_the_cap_still_counts_the_snapshot_at_its_exact_size(tmp_path):
    """With ``max_bytes`` exactly what an uncapped run writes, every step is recorded; a byte less, the last one is
    not (the snapshot's bound, larger than the file, never decides a step record)."""
    _train(tmp_path / "free", steps=20, snapshot_steps=(0,))
    free = open_watched(tmp_path / "free")
    total = ((free["code"] or {}).get("bytes", 0) + free["snapshots"][0]["bytes"]
             + len((tmp_path / "free" / "steps.jsonl").read_text(encoding="utf-8")))
    _train(tmp_path / "exact", steps=20, snapshot_steps=(0,), max_bytes=total)
    exact = open_watched(tmp_path / "exact")
    assert exact["steps"] == 20 and not exact["truncated"] and len(exact["snapshots"]) == 1
    _train(tmp_path / "less", steps=20, snapshot_steps=(0,), max_bytes=total - 1)
    less = open_watched(tmp_path / "less")
    assert less["steps"] == 19 and less["truncated"] and len(less["snapshots"]) == 1


# --- a write that fails --------------------------------------------------------------------------------------------
CASES = {  # how the snapshot's step ended -> (loop settings, the step and place the failure is said at)
    "w.step": ({"snapshot_steps": (0,)}, 0, "w.step"),
    "the next forward": ({"snapshot_steps": (0,), "explicit": False}, 0, "the forward pre-hook of Net"),
    "the last w.step": ({"snapshot_steps": (4,)}, 4, "w.step"),
    "the block's end": ({"snapshot_steps": (4,), "explicit": False}, 4, "the block's end"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_snapshot_that_cannot_be_written_stops_the_recording_as_it_did(tmp_path, monkeypatch, capsys, case):
    """Disk full while the file is written: the loop runs on unchanged, and the watch says - in the manifest's
    ``watch_error``, its note and one line on stderr - that it stopped at the snapshot's step, where that step
    ended; that step's record and the later ones are not kept, no temporary file is left."""
    kw, step, where = CASES[case]
    bare = _train(explicit=kw.get("explicit", True))
    original = np.lib.format.write_array_header_1_0

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np.lib.format, "write_array_header_1_0", disk_full)
    assert _train(tmp_path / "run", **kw) == bare  # bitwise: the loop ran on as without the watch
    monkeypatch.setattr(np.lib.format, "write_array_header_1_0", original)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("convcheck.watch:")]
    said = (f"recording stopped at step {step}: convcheck.watch failed in {where} (OSError: [Errno 28] No space "
            "left on device) - the disk is full or over its quota where the run is written: free some space or "
            "give another out=; the training loop ran on, unrecorded")
    assert "convcheck's fault" not in said  # the user's disk, not a bug to report
    assert err == [f"convcheck.watch: {said}"]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["truncated"] and said in manifest["notes"]
    assert manifest["watch_error"] == {"step": step, "where": where, "exception": "OSError",
                                       "message": "[Errno 28] No space left on device"}
    run = open_watched(tmp_path / "run")
    assert run["steps"] == len(run.steps) == step and run["snapshots"] == [] and run["stopped"] is None
    assert _leftovers(tmp_path / "run") == []
    assert [f for f in os.listdir(tmp_path / "run" / "snapshots") if f.startswith("step_")] == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own priority is Linux's")
def test_the_writer_thread_runs_nicer_than_the_loop(tmp_path):
    """On busy cores the loop is scheduled first and the snapshot written in the time left; the training thread's
    own priority is left as it was."""
    from convcheck.watch import snapshot_file

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    job = snapshot_file.Background(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
                                   step=0, where="test", bound=0)
    job.wait()
    assert seen == [min(19, before + snapshot_file.NICER)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_the_archive_is_a_zip64_npz_that_zipfile_numpy_and_unzip_read(tmp_path):
    """Hundreds of small members, a large one, an empty array, a 0-d one and a non-ASCII name, written by
    ``snapshot_file._Archive``: every member's CRC checks out, ``np.load`` gives back each array exactly, the size and
    SHA-256 returned are the file's, and ``unzip -t`` (where installed) finds no error."""
    import hashlib
    import shutil

    from convcheck.watch.snapshot_file import write_npz

    g = np.random.default_rng(0)
    members = [(f"out/cell/{k}/0", g.standard_normal((16, 8)).astype(np.float32)) for k in range(300)]
    members += [("big", g.standard_normal(70000)), ("empty", np.zeros((0, 3), np.float32)),
                ("zero_d", np.array(3.5)), ("grad/ünï", np.arange(5))]
    n, sha = write_npz(tmp_path / "s.npz", members)
    data = (tmp_path / "s.npz").read_bytes()
    assert n == len(data) and sha == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(tmp_path / "s.npz") as z:
        assert z.testzip() is None and len(z.namelist()) == len(members)
        assert all(i.flag_bits & 0x08 and i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    with np.load(tmp_path / "s.npz") as f:
        for name, a in members:
            got = f[name]
            assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a), name
    if shutil.which("unzip"):
        done = subprocess.run(["unzip", "-tq", str(tmp_path / "s.npz")], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_small_snapshot_is_whole_with_its_steps_record_at_the_steps_end(tmp_path):
    """Under ``BACKGROUND_FROM`` bytes the step waits for its snapshot: the file is there and every step's record is in
    ``steps.jsonl`` as the next step begins (a process killed then keeps them: ``test_watch_perf``'s killed run)."""
    path = tmp_path / "run" / "snapshots" / "step_00000.npz"
    seen = []

    def during(i, w):
        seen.append((path.exists(), len((tmp_path / "run" / "steps.jsonl").read_text().splitlines())))

    _train(tmp_path / "run", during=during, snapshot_steps=(0,))
    assert seen[1:] == [(True, i) for i in range(1, len(seen))]
