"""Issue 45: a large CPU tensor's statistics on one thread (``stats._measure_serial``: the bits' signed and unsigned
extremes, the zero count and the least nonzero bits read a piece at a time, no tensor of its size written) are the
torch passes' values exactly - counts, extremes, and the sum and sum of squares bit for bit. A float32/float64 CPU
tensor takes ``fused.scan``'s one pass before either (numba): its counts and extremes exact too, its sums in float64
(close to torch's, not bit for bit)."""

from __future__ import annotations

import json
import math

import numpy as np

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.runformat import statistics
from convcheck.watch import fused, stats


def _reference(t: torch.Tensor) -> dict:
    """The statistics the slow, obvious way, in float64 over the finite values."""
    x = t.detach().double().flatten()
    fin = x[torch.isfinite(x)]
    nz = fin[fin != 0].abs()
    return {"n": t.numel(), "max_abs": fin.abs().max().item() if fin.numel() else 0.0,
            "min_nonzero": nz.min().item() if nz.numel() else None, "zeros": int((fin == 0).sum()),
            "nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum())}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and isinstance(b[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
        for k in a)


def _no_fused(monkeypatch) -> None:
    """``fused.scan``'s pass not there (as without numba): the torch and numpy passes."""
    fused.ready()
    monkeypatch.setattr(fused, "_KERNELS", {})


def _serial(monkeypatch, piece: int | None = None) -> None:
    """Every tensor (but a slice, a subclass, another device) through ``_measure_serial``, whatever torch's threads."""
    _no_fused(monkeypatch)
    monkeypatch.setattr(stats, "LARGE", 0)
    monkeypatch.setattr(stats, "SERIAL_THREADS", 1 << 20)
    if piece is not None:
        monkeypatch.setattr(stats, "PIECE", piece)


def _torch_path(t: torch.Tensor, monkeypatch) -> dict:
    with monkeypatch.context() as m:
        m.setattr(stats, "LARGE", 1 << 62)
        _no_fused(m)
        return stats.measure(t)


def _cases(dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 20, generator=g).to(dtype)  # its slice and transpose views of a tensor of ``dtype``
    late = torch.full((40,), 3.0)
    late[33] = 2.0**-9  # the smallest nonzero magnitude in the last piece, zeros in the first
    late[:5] = 0.0
    mixed_zeros = late.clone()
    mixed_zeros[1] = -0.0
    img = torch.randn(2, 3, 4, 5, generator=g).to(dtype)
    cases = [x, x.relu(), -x.relu(), x.abs(), -x.abs(), x.t(), x[:, ::3],
             x * (torch.rand(30, 20, generator=g) > 0.5), late, -late, mixed_zeros, -mixed_zeros,
             img.contiguous(memory_format=torch.channels_last),
             img.relu().contiguous(memory_format=torch.channels_last), img.permute(0, 2, 3, 1), torch.zeros(5),
             -torch.zeros(5), torch.tensor([0.0, -0.0]), torch.tensor([0.0, -0.0, 3.0]),
             torch.tensor([-1.0, -0.0, -3.0]),
             torch.tensor([-0.0, 0.0, 3.0, 2.0**-14]), torch.tensor([-0.0, -2.0, 0.0]), torch.tensor([2.0, 3.0, -0.0]),
             torch.tensor([-2.0, -3.0, 0.0]), torch.tensor([-0.0, 1.0, -1.0]), torch.tensor([0.0, 1.0, -1.0]),
             torch.tensor([0.0, -1e-3, 2.0]), torch.tensor([-2.0, -3.0, 0.0, 1e-3]), torch.tensor([2.0**-20, 0.0, 5.0]),
             torch.tensor([0.0] * 7 + [1.0]), torch.tensor([-0.0] * 7 + [-1.0]), torch.tensor([0.0] * 6 + [-0.5, 0.0]),
             torch.tensor([-2.0]), torch.tensor([0.0]), torch.tensor([float("nan"), 0.0, 1.0]),
             torch.tensor([float("inf"), -1.0, 0.0]), torch.tensor([-float("inf"), 1.0]), torch.tensor([])]
    if dtype in (torch.float32, torch.float64):  # subnormals of either sign beside zeros, or beside each other
        cases += [torch.tensor([1e-40, -3e-42, 0.0, 5.0]), torch.tensor([1e-40, -3e-42, 5.0]),
                  torch.tensor([-1e-40, -3e-42, -0.0]), torch.tensor([1e-45, 2.0, -0.0])]
    if dtype == torch.float16:
        cases.append(torch.tensor([6e-8, -0.0, 1.0]))  # float16's smallest subnormal
    return [c.to(dtype) for c in cases]


@pytest.mark.parametrize("piece", [None, 3], ids=["one-piece", "pieces-of-3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_serial_scan_gives_the_torch_passes_values_exactly(dtype, piece, monkeypatch):
    """Zeros of both signs, all-zero tensors, a single nonzero, subnormals, NaN/Inf, transposed and channels_last
    tensors, pieces that hold zeros next to pieces that do not: the whole row the torch passes give (the sum and the
    sum of squares too: both paths reduce the same tensor with the same torch ops), and the reference's counts and
    extremes."""
    cases = _cases(dtype)
    _serial(monkeypatch, piece)
    taken = 0
    for c in cases:
        taken += stats._serial_bits(c) is not None
        got, ref = stats.measure(c), _reference(c)
        assert _same(got, _torch_path(c, monkeypatch)), c
        for key in ("n", "max_abs", "min_nonzero", "zeros", "nan", "inf"):
            assert got[key] == ref[key], (key, c)
        assert math.copysign(1.0, got["max_abs"]) > 0, c  # never -0.0
    assert taken == len(cases) - 2  # the slice (x[:, ::3]) and the empty tensor take the torch passes


def test_a_tensor_bigger_than_the_torch_chunk_with_zeros_of_both_signs_in_some_pieces(monkeypatch):
    """More than ``CHUNK`` elements with the default ``PIECE``: a ReLU-like tensor whose -0's, subnormal and largest
    value lie in different pieces, and a both-signed one without zeros but one in its last piece."""
    monkeypatch.setattr(stats, "SERIAL_THREADS", 1 << 20)
    _no_fused(monkeypatch)
    g = torch.Generator().manual_seed(2)
    n = stats.CHUNK + 3 * stats.PIECE + 5
    x = torch.randn(n, generator=g).relu()
    x[7], x[stats.PIECE + 1] = -0.0, 1e-41
    x[n - 2] = 40.0
    both = torch.randn(n, generator=g)
    both[both == 0] = 1.0
    late = both.clone()
    late[n - 1] = 0.0
    for t in (x, x.bfloat16(), x.double(), both, late, both.half()):
        assert stats._serial_bits(t) is not None
        got = stats.measure(t)
        assert _same(got, _torch_path(t, monkeypatch))
        ref = _reference(t)
        assert all(got[k] == ref[k] for k in ("n", "max_abs", "min_nonzero", "zeros", "nan", "inf"))
    row = stats.measure(x)
    assert row["zeros"] == int((x == 0).sum()) and row["min_nonzero"] == float(x[stats.PIECE + 1]) < 1e-40


def test_the_serial_scan_is_taken_only_where_it_pays_and_reads_the_tensor_itself(monkeypatch):
    """Not for a small tensor, a slice, a subclass, a negated view, another device, or torch on more threads than
    ``SERIAL_THREADS``; where it is taken, numpy reads the tensor's own memory (no copy)."""
    big = torch.randn(4, 8, stats.LARGE)
    assert stats._serial_bits(big[:, :, :2]) is None  # small
    monkeypatch.setattr(stats, "SERIAL_THREADS", 1 << 20)
    u = stats._serial_bits(big)
    assert u is not None and u.ctypes.data == big.data_ptr() and u.size == big.numel()
    cl = stats._serial_bits(torch.randn(2, 16, 32, 64).to(memory_format=torch.channels_last))
    assert cl is not None and cl.flags["C_CONTIGUOUS"]
    assert stats._serial_bits(big[:, ::2]) is None
    assert stats._serial_bits(big.expand(2, 4, 8, stats.LARGE)) is None

    class Sub(torch.Tensor):
        pass

    assert stats._serial_bits(big.as_subclass(Sub)) is None
    negated = torch._neg_view(big)  # a lazily negated view (numpy cannot read it): the torch passes, the right values
    assert stats._serial_bits(negated) is None and stats.measure(negated)["max_abs"] == float(big.abs().max())
    assert stats._serial_bits(torch.empty(4, 8, stats.LARGE, device="meta")) is None
    monkeypatch.setattr(stats, "SERIAL_THREADS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert stats._serial_bits(big) is None


def test_a_declared_statistic_is_read_with_the_serial_scans_sums(monkeypatch):
    """A declared statistic's reduction goes into the same read on this path too, and gives the same value."""
    monkeypatch.setattr(statistics, "STATISTICS", statistics.STATISTICS)
    statistics.declare(statistics.Statistic(
        "l1_sum", "sum |x|", "scale", optional=True, reduce=lambda x, acc: x.abs().sum(dtype=acc)))
    _serial(monkeypatch)
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)).relu()
    for t in (x, x.bfloat16()):
        got = stats.measure(t)
        assert _same(got, _torch_path(t, monkeypatch))
        assert got["l1_sum"] == float(t.abs().sum(dtype=stats.reduce_dtype(t)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        self.pool, self.fc = nn.MaxPool2d(2), nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        return self.fc(self.pool(self.relu(self.bn(self.conv(x)))).flatten(1))


def _watched(out, **watch_args) -> str:
    torch.manual_seed(0)
    model = _Net().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out, snapshot_steps=(), **watch_args) as w:
        for _ in range(2):
            x = torch.randn(4, 3, 16, 16, generator=g).contiguous(memory_format=torch.channels_last)
            loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (4,), generator=g))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    return (out / "steps.jsonl").read_text()


def test_a_watched_run_records_the_same_rows_through_the_serial_scan(tmp_path, monkeypatch):
    """A channels_last CNN's watched steps (conv, batch norm, in-place ReLU, max-pool outputs): the same
    ``steps.jsonl``, byte for byte, through the serial scan, the torch passes, and ``sync="step"``'s device rows."""
    scans = []
    with monkeypatch.context() as m:
        _serial(m, piece=100)
        scan = stats._scan
        m.setattr(stats, "_scan", lambda u: scans.append(u.size) or scan(u))
        scanned = _watched(tmp_path / "scan")
    assert len(scans) >= 2 * 5  # every leaf's output, every step
    monkeypatch.setattr(stats, "LARGE", 1 << 62)
    with monkeypatch.context() as m:
        _no_fused(m)
        assert scanned == _watched(tmp_path / "torch") == _watched(tmp_path / "step", sync="step")
    layers = json.loads(scanned.splitlines()[0])["layers"]
    assert layers["relu"]["zeros"] > 0.3 and 0 < layers["pool"]["zeros"] < 0.3 and layers["conv"]["zeros"] == 0
    assert all(layers[k]["min_nonzero"] > 0 for k in layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_pass_gives_exact_counts_and_extremes_and_close_sums(dtype, monkeypatch):
    """``fused.scan``'s one pass over every case above: the reference's counts and extremes exactly, NaN/Inf counted by
    the exact path, and the sum and sum of squares within float32 rounding of the torch passes' (float64 here)."""
    if not fused.ready():
        pytest.skip("numba cannot compile here: the torch and numpy passes are the only ones")
    taken = []
    scan = fused.scan

    def counted(values, bits):
        got = scan(values, bits)
        taken.extend([values.size] if got is not None else [])
        return got

    monkeypatch.setattr(fused, "scan", counted)
    cases = _cases(dtype) + [torch.randn(3, 70000, dtype=dtype).relu(), -torch.randn(70000, dtype=dtype).abs()]
    for c in cases:
        got, ref, slow = stats.measure(c), _reference(c), _torch_path(c, monkeypatch)
        for key in ("n", "max_abs", "min_nonzero", "zeros", "nan", "inf", "dtype", "calls"):
            assert got[key] == ref.get(key, slow[key]), (key, c)
        for key in ("sum", "sumsq"):
            assert math.isclose(got[key], slow[key], rel_tol=1e-5, abs_tol=1e-30) or math.isnan(slow[key]), (key, c)
        assert math.copysign(1.0, got["max_abs"]) > 0, c
    # not the slice (x[:, ::3]) or the empty tensor; the three holding NaN or Inf read by the exact path after it
    assert len(taken) == len(cases) - 2 - 3


def test_the_fused_pass_is_left_where_it_would_not_pay_or_cannot_read(monkeypatch):
    """Not for a float16/bfloat16 tensor, a declared statistic, a slice, a large tensor while torch runs on more
    threads than ``SERIAL_THREADS``; and ``CONVCHECK_NO_FUSED=1`` turns it off for the process."""
    if not fused.ready():
        pytest.skip("numba cannot compile here")
    big = torch.randn(4, 8, stats.LARGE)
    assert stats._measure_fused(big, big) is not None
    assert stats._measure_fused(big[:, ::2], big) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert stats._measure_fused(big, big) is None and stats._measure_fused(big[0, 0, :8].clone(), big) is not None
    monkeypatch.setenv(fused.ENV_OFF, "1")
    assert fused._compile() == {}
    monkeypatch.setenv(fused.ENV_OFF, "0")
    assert fused._compile()


def test_a_watched_run_through_the_fused_pass_records_the_torch_rows_counts_and_extremes(tmp_path, monkeypatch):
    if not fused.ready():
        pytest.skip("numba cannot compile here")
    fast = [json.loads(line) for line in _watched(tmp_path / "fused").splitlines()]
    _no_fused(monkeypatch)
    slow = [json.loads(line) for line in _watched(tmp_path / "torch").splitlines()]
    for a, b in zip(fast, slow):
        assert a["layers"].keys() == b["layers"].keys()
        for name in a["layers"]:
            x, y = a["layers"][name], b["layers"][name]
            assert {k: x[k] for k in ("n", "max_abs", "min_nonzero", "zeros", "nan", "inf")} == \
                {k: y[k] for k in ("n", "max_abs", "min_nonzero", "zeros", "nan", "inf")}, name
            assert math.isclose(x["mean"], y["mean"], rel_tol=1e-4, abs_tol=1e-7)
            assert math.isclose(x["std"], y["std"], rel_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_pass_is_exact_wherever_the_extremes_and_zeros_lie(dtype):
    """Tensors of sizes up to a few times a vector loop's blocks (the compiler's, 256 elements in a variant tried), with
    zeros of either sign, a tiny value and the largest one planted anywhere, all signs or one, give the reference's
    counts and extremes exactly and its sums to float32 rounding."""
    if not fused.ready():
        pytest.skip("numba cannot compile here")
    g = torch.Generator().manual_seed(1)
    for case in range(120):
        n = int(torch.randint(1, 4 * 256 + 40, (1,), generator=g))
        x = torch.randn(n, generator=g, dtype=torch.float64)
        sign = case % 3  # both signs, non-negative, non-positive
        x = x if sign == 0 else x.abs() if sign == 1 else -x.abs()
        if case % 4:  # zeros of either sign, a fraction of them
            x[torch.rand(n, generator=g) < 0.1 * (case % 4)] = 0.0 if case % 2 else -0.0
        at = torch.randint(0, n, (2,), generator=g).tolist()
        x[at[0]] = (1e-30 if dtype == torch.float32 else 1e-300) * (-1 if case % 5 == 0 else 1)
        x[at[1]] = 1e3 * (-1 if case % 7 == 0 else 1)
        if case % 11 == 0:
            x.zero_()
        t = x.to(dtype)
        ref = _reference(t)
        values = t.numpy()
        got = fused.scan(values, values.view(np.uint32 if dtype == torch.float32 else np.uint64))
        total, squares, top, least, zeros = got
        assert stats._value(top, dtype) == ref["max_abs"], case
        assert (None if least is None else stats._value(least, dtype)) == ref["min_nonzero"], case
        assert zeros == ref["zeros"], case
        exact = t.double()
        assert math.isclose(total, float(exact.sum()), rel_tol=1e-6, abs_tol=1e-6 * float(exact.abs().sum())), case
        assert math.isclose(squares, float((exact * exact).sum()), rel_tol=1e-6), case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_largest_is_measures_max_abs_and_inf_where_a_nan_or_inf_is(dtype):
    """``stats.largest`` (a snapshot's worst measure of a stacked call): ``measure``'s max|x| over every case above, a
    large tensor and a transposed one; Inf for a tensor holding NaN or Inf."""
    for c in _cases(dtype) + [torch.randn(300, 300).to(dtype), torch.randn(40, 30).to(dtype).t()]:
        if not c.numel():
            continue
        row = stats.measure(c)
        want = math.inf if row["nan"] or row["inf"] else row["max_abs"]
        assert stats.largest(c) == want, c


def test_the_fused_pass_keeps_the_std_of_tiny_values_and_of_values_far_from_zero():
    """The one pass sums in float64: a float32 tensor of values near 1e-25 (whose squares float32 cannot hold) and one
    whose std is 1e-4 of its mean (1000 + 0.1 x noise, which float32 sums of squares cancel) keep the
    std a float64 reference gives (a variant summing blocks in float32, tried, lost both); an empty array is nothing."""
    if not fused.ready():
        pytest.skip("numba cannot compile here")
    g = torch.Generator().manual_seed(2)
    for t in (torch.randn(5000, generator=g) * 1e-25, 1000 + 0.1 * torch.randn(4096, generator=g),
              torch.randn(300, generator=g) * 1e-25):
        got = stats.finish(stats.measure(t))
        ref = t.double()
        assert math.isclose(got["std"], float(ref.std(unbiased=False)), rel_tol=1e-3), (got["std"], float(ref.std()))
        assert math.isclose(got["mean"], float(ref.mean()), rel_tol=1e-6)
    empty = np.empty(0, dtype=np.float32)
    assert fused.scan(empty, empty.view(np.uint32)) == (0.0, 0.0, 0, None, 0)
