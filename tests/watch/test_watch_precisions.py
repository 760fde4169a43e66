"""One user loop recorded in float32, bfloat16 autocast and a bfloat16-cast model, and a hand-written
log-sum-exp loss under float16 autocast: what ``convcheck diff`` says of each pair (the new-user trial)."""

from __future__ import annotations

import json

import pytest
import torch

from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrapped

from .loops import unhashed
from .precision_loops import lse_run, sensor_run


def diff(capsys, *args) -> tuple[int, str]:
    code = main(["diff", *map(str, args), "--no-save"])
    return code, unwrapped(capsys.readouterr().out)  # the prose wrapped at 100 columns read whole


def verdict(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("verdict: "))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precisions")
    for name, precision in (("fp32", "fp32"), ("autocast", "autocast-bf16"), ("cast", "bf16")):
        sensor_run(tmp / name, precision)
    sensor_run(tmp / "cast_seed1", "bf16", seed=1)
    sensor_run(tmp / "raw_fp32", "fp32", raw=True)
    sensor_run(tmp / "raw_cast", "bf16", raw=True)
    return tmp


def test_a_healthy_bf16_autocast_run_agrees_with_its_float32_run(runs, capsys):
    # the losses differ by up to a few bfloat16 roundoffs (compounding over the steps) and end the same
    code, out = diff(capsys, runs / "fp32", runs / "autocast")
    assert verdict(out) == "verdict: ok: the two watched runs agree within rounding at every aligned step"
    assert code == 0


def test_a_bf16_cast_model_fed_cast_inputs_sees_the_same_data(runs, capsys):
    code, out = diff(capsys, runs / "fp32", runs / "cast")
    assert "data: the same batches at every aligned step" in out
    assert verdict(out) == ("verdict: ok: the two watched runs agree within rounding: their losses wander apart "
                            "from step 21 (different precisions) but end alike")
    assert "rounding differences compounding over the steps" in out
    assert code == 0


def test_a_cast_model_with_a_one_pass_variance_is_named_by_its_layer(runs, capsys):
    code, out = diff(capsys, runs / "raw_fp32", runs / "raw_cast")
    assert "data: the same batches at every aligned step" in out
    assert verdict(out).startswith("verdict: layer: in both runs, norm computes beyond its floor at step 0")
    assert code == 1


def test_a_cast_model_on_other_data_is_still_a_setup_verdict(runs, capsys):
    code, out = diff(capsys, runs / "fp32", runs / "cast_seed1")
    assert verdict(out).startswith("verdict: setup: the runs did not see the same data: different data from step 0")
    assert code == 1


def test_a_run_recorded_without_rounded_hashes_is_compared_by_its_bytes(runs, tmp_path, capsys):
    import shutil

    old = tmp_path / "old_cast"
    shutil.copytree(runs / "cast", old)
    lines = [json.loads(line) for line in (old / "steps.jsonl").read_text().splitlines()]
    assert all("batch_rounded" in rec for rec in lines)
    (old / "steps.jsonl").write_text("".join(json.dumps({k: v for k, v in rec.items() if k != "batch_rounded"})
                                             + "\n" for rec in lines))
    unhashed(old)  # recorded before batch_rounded, so before the files' SHA-256 too
    code, out = diff(capsys, runs / "fp32", old)
    assert verdict(out).startswith("verdict: setup: the runs did not see the same data")
    assert code == 1


def test_an_overflowing_exp_in_the_loss_is_named_in_its_forward(tmp_path, capsys):
    lse_run(tmp_path / "fp32", fp16=False)
    losses = lse_run(tmp_path / "fp16", fp16=True)
    assert losses[5] == float("inf")
    code, out = diff(capsys, tmp_path / "fp32", tmp_path / "fp16")
    assert verdict(out) == ("verdict: numerics: B turns non-finite at step 5 in the loss (own code: exp, forward); "
                            "A stays finite")
    assert "first non-finite in B: the loss (own code: exp, forward) at step 5: the loss is inf" in out
    assert "  remedy: subtract the maximum before exp" in out
    assert "sqrt(d)" not in out
    assert "  remedy: compute the loss in float32: outside autocast" in out
    assert "that layer's operation" not in out  # the loss is no layer
    assert code == 1
    code, out = diff(capsys, tmp_path / "fp16", "--judge", "cpu:float64")
    assert verdict(out) == "verdict: numerics: the run turns non-finite at step 5 in the loss (own code: exp, forward)"
    assert code == 1


def test_a_large_batch_is_the_same_data_in_bf16_and_fp16_and_another_one_is_not():
    """Past ``ROUNDED_SAMPLE`` elements the rounded hashes read an evenly spaced sample: a batch cast to a
    16-bit format still matches its float32 self, and another batch of the same shape does not."""
    from convcheck.watch.batches import ROUNDED_SAMPLE, rounded_hashes

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 200, 200, generator=g)  # 480,000 elements
    assert x.numel() > ROUNDED_SAMPLE
    mine = rounded_hashes((x,), {})
    assert rounded_hashes((x.to(torch.bfloat16),), {})["bfloat16"] == mine["bfloat16"]
    assert rounded_hashes((x.half(),), {})["float16"] == mine["float16"]
    other = rounded_hashes((torch.randn(4, 3, 200, 200, generator=g),), {})
    assert other["bfloat16"] != mine["bfloat16"] and other["float16"] != mine["float16"]
    assert rounded_hashes((x.reshape(4, 3, 400, 100),), {})["bfloat16"] != mine["bfloat16"]  # the shape counts


def _runs(losses_a, losses_b, dtype_b="bfloat16"):
    import types

    def run(losses, dtype):
        return types.SimpleNamespace(steps=[{"loss": v, "layers": {"fc": {"dtype": dtype}}} for v in losses])

    return run(losses_a, "float32"), run(losses_b, dtype_b)


def _curve(first, last, n=30):
    return [first + (last - first) * k / (n - 1) for k in range(n)]


@pytest.mark.parametrize("b_losses, parts", [
    (_curve(2.41, 0.197), False),  # the healthy bf16-cast run of the trial: 9% above float32's end
    (_curve(2.45, 0.150), True),   # 3.7x float32's end (review): not rounding
    (_curve(2.40, 0.040)[:15] + [5.0] + _curve(2.40, 0.040)[16:], True),  # a mid-run spike of 100x
])
def test_losses_at_different_precisions_part_unless_they_end_alike(b_losses, parts):
    from convcheck.analysis.diff import _loss_parting

    a, b = _runs(_curve(2.34, 0.18) if not parts else _curve(2.34, 0.040), b_losses)
    step, wander = _loss_parting(a, b, 30)
    assert (step is not None) == parts
    assert (wander is not None) == (not parts)


def test_final_losses_on_either_side_of_zero_do_not_end_alike():
    from convcheck.analysis.diff import ends_alike

    assert not ends_alike(-0.5, 0.45, 2.0, 2.0, 0.01)  # an NLL ending below 0 beside one above it (review)
    assert ends_alike(-0.50, -0.45, 2.0, 2.0, 0.01)


def test_an_autocast_that_leaves_a_float64_model_alone_is_no_precision_of_the_run(tmp_path):
    """CPU autocast casts float32 ops only: a float64 model under it computes in float64, bit for bit as without it;
    the diff does not call the pair a bfloat16 one."""
    import torch
    import torch.nn as nn

    import convcheck
    from convcheck.analysis.diff import diff_watched

    def run(out, amp):
        convcheck.seed_everything(0)
        model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1)).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        with convcheck.watch(model, opt, out=out) as w:
            for _ in range(4):
                x = torch.randn(8, 5, generator=g, dtype=torch.float64)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = nn.functional.mse_loss(model(x), x[:, :1])
                opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)

    run(tmp_path / "a", False)
    run(tmp_path / "b", True)
    d = diff_watched(tmp_path / "a", tmp_path / "b")
    assert d.verdict.category == "ok", d.verdict.headline
    assert d.policy == () and "bfloat16" not in " ".join(d.lines())
