"""Issue 42: the watched diff's method - the recipe first, the step in causal order, precision judged by its
outcome. Each test is a loop as a user writes it (``method_loops.py``), run twice, then ``convcheck diff``."""

from __future__ import annotations

import json

import pytest
import torch

from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrapped
from tests.watch import method_loops as L


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def diff(capsys, a, b) -> tuple[int, str]:
    code = main(["diff", str(a), str(b)])
    return code, unwrapped(capsys.readouterr().out)  # the prose wrapped at 100 columns read whole


def verdict(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("verdict: "))


def test_a_healthy_bf16_autocast_pair_of_a_language_model_is_ok_not_different_data(tmp_path, capsys):
    """The LSTM's hidden state is carried from chunk to chunk (detached): it is the model's own output, not data;
    under bf16 autocast it differs from float32's from the first step, by design."""
    L.lstm_run(tmp_path / "fp32")
    L.lstm_run(tmp_path / "bf16", precision="bf16")
    code, out = diff(capsys, tmp_path / "fp32", tmp_path / "bf16")
    assert code == 0, out
    assert verdict(out).startswith("verdict: ok: ")
    assert "data: the same batches at every aligned step" in out
    assert "precision: autocast: off | bfloat16" in out


def test_a_healthy_bf16_autocast_cnn_and_vae_are_ok(tmp_path, capsys):
    for run in (L.cnn_run, L.vae_run):
        run(tmp_path / run.__name__ / "fp32")
        run(tmp_path / run.__name__ / "bf16", precision="bf16")
        code, out = diff(capsys, tmp_path / run.__name__ / "fp32", tmp_path / run.__name__ / "bf16")
        assert code == 0 and verdict(out).startswith("verdict: ok: "), out


def test_a_missing_zero_grad_is_setup_naming_it_not_nondeterminism(tmp_path, capsys):
    L.cnn_run(tmp_path / "a")
    L.cnn_run(tmp_path / "b", zero_grad=False)
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert verdict(out) == ("verdict: setup: B's gradients accumulate across steps: optimizer.zero_grad() is not "
                            "called between its steps (from step 1)")
    assert "  remedy: call optimizer.zero_grad() once per optimizer step" in out


def test_a_kl_term_with_its_sign_flipped_is_setup_in_the_gradients(tmp_path, capsys):
    """At the start the KL is a thousandth of the loss (within its rounding tolerance): the flip shows first in the
    gradients, with the forward and the loss still agreeing."""
    L.vae_run(tmp_path / "a", d=400)
    L.vae_run(tmp_path / "b", d=400, kl_sign=-1.0)
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert verdict(out).startswith("verdict: setup: the gradients differ at step 0 where the forward agrees and the "
                                   "loss differs by only ")
    assert ": the loss is built differently (a term, its sign or its weight)" in verdict(out)


def test_a_hundred_times_the_learning_rate_in_an_lstm_is_the_learning_rate_not_data(tmp_path, capsys):
    L.lstm_run(tmp_path / "a")
    L.lstm_run(tmp_path / "b", lr=100.0)
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert verdict(out) == ("verdict: setup: different learning rates: B's learning rate is 100.0 where A's is 1.0 "
                            "from step 0")
    assert "did not see the same data" not in out


def test_a_gan_against_itself_is_ok_not_both_diverging(tmp_path, capsys):
    """The generator's loss rises from 0.62 to 4.2 as the discriminator wins, its weights barely move."""
    L.gan_run(tmp_path / "a")
    L.gan_run(tmp_path / "b")
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0, out
    assert verdict(out).startswith("verdict: ok: ")


def test_a_gan_watched_whole_in_bf16_is_ok_its_fakes_are_not_data(tmp_path, capsys):
    """The discriminator is fed the generator's fakes (detached): made by the process, they differ with the
    precision and are not "different data"."""
    L.gan_run(tmp_path / "fp32", both=True)
    L.gan_run(tmp_path / "bf16", both=True, precision="bf16")
    code, out = diff(capsys, tmp_path / "fp32", tmp_path / "bf16")
    assert code == 0, out
    assert "data: the same batches at every aligned step" in out


def test_a_dcgan_with_the_discriminator_watched_alone_is_ok_in_bf16(tmp_path, capsys):
    """Only netD is watched (as in pytorch/examples' dcgan); it is fed netG's detached fakes, the output of a
    module no watch holds: made by the process, not data."""
    L.dcgan_run(tmp_path / "fp32")
    L.dcgan_run(tmp_path / "bf16", precision="bf16")
    code, out = diff(capsys, tmp_path / "fp32", tmp_path / "bf16")
    assert code == 0, out
    assert "data: the same batches at every aligned step" in out


def test_a_step0_loss_difference_outranks_a_later_difference_of_made_inputs(tmp_path, capsys):
    """The discriminator's real batch labelled fake in B: its loss is given other targets at step 0 (same weights,
    same batch); that is the cause, whatever parts after it (the generator's fakes, model-made)."""
    L.dcgan_run(tmp_path / "a")
    L.dcgan_run(tmp_path / "b", flip_labels=True)
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert verdict(out) == ("verdict: setup: the loss was given other targets (labels) from step 0, with the same "
                            "model inputs")
    assert "also: the runs compute a different loss: at step 0" in out


def test_weight_decay_on_the_norms_in_one_run_only_is_named_per_parameter(tmp_path, capsys):
    """One parameter group with weight decay on everything against two groups keeping it off the norms and
    biases: the same learning rate everywhere, so only the per-parameter settings tell them apart."""
    L.cnn_run(tmp_path / "a")
    L.cnn_run(tmp_path / "b", wd_on_norms=True)
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert verdict(out) == ("verdict: setup: different optimizer settings per parameter: weight_decay 0.005 on "
                            "conv1.bias, bn1.*, conv2.bias, bn2.* and 1 more in B; A: 0")
    assert "learning rate" not in verdict(out)


def test_a_backbone_never_unfrozen_is_named(tmp_path, capsys):
    L.finetune_run(tmp_path / "a", unfreeze_at=5)
    L.finetune_run(tmp_path / "b", unfreeze_at=None)
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert verdict(out) == "verdict: setup: backbone.* never get a gradient in B; in A they do from step 5"


def test_a_bf16_run_ending_far_above_float32_is_not_ok_although_the_loss_fell_orders_of_magnitude(tmp_path, capsys):
    """Least squares: float32 reaches 1e-13, bfloat16 autocast stalls near 1e-4 - both far below the first loss
    of 8.5, so a share of the fall would call them alike; against the runs' own noise they are not."""
    L.fit_run(tmp_path / "fp32")
    L.fit_run(tmp_path / "bf16", precision="bf16")
    code, out = diff(capsys, tmp_path / "fp32", tmp_path / "bf16")
    assert code == 1
    assert verdict(out).startswith("verdict: numerics: ")
    assert "the losses end apart (B worse)" in out


def test_a_float64_model_against_its_float32_twin_is_a_healthy_precision_pair(tmp_path, capsys):
    """The float64 twin is fed x.to(torch.float64): the same data, rounded to float32 (issue 48)."""
    L.twin_run(tmp_path / "fp32")
    L.twin_run(tmp_path / "fp64", dtype=torch.float64)
    code, out = diff(capsys, tmp_path / "fp32", tmp_path / "fp64")
    assert code == 0, out
    assert "data: the same batches at every aligned step" in out
    assert "precision: weights kept in float32 | float64" in out


@pytest.mark.slow  # ~6 s: the slow pass (the README's command stays under 3 minutes)
def test_lbfgs_pairs_identical_ok_and_without_zero_grad_in_the_closure_named_in_the_gradients(tmp_path, capsys):
    """LBFGS evaluates its closure up to max_iter times a step and moves the parameters between the evaluations
    (issue 48): the same command twice is ok; the closure without zero_grad accumulates gradients across its
    evaluations - the first evaluation's forward agrees, the gradients are the first place the runs differ."""
    L.lbfgs_run(tmp_path / "a")
    L.lbfgs_run(tmp_path / "b")
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0 and verdict(out).startswith("verdict: ok: "), out
    # every evaluation replayed by the judge with its own parameters (issue 48: LBFGS moves them between evaluations)
    assert out.count("step 0's 5 closure evaluations each replayed with its own parameters") == 2
    assert "400 layer calls at step 0 replayed: all within their floors" in out and "not replayed: step 0" not in out
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    judged = json.loads(capsys.readouterr().out)["judge_replay"][0]
    assert judged["closure_evaluations"] == {"0": {"evaluations": 5, "replayed": 5}} and judged["complete"]
    assert judged["layers_replayed"] == {n: {"calls": 200, "flagged": 0, "overflowed": 0}
                                         for n in ("net.cell", "net.head")}
    L.lbfgs_run(tmp_path / "c", zero_grad=False)
    code, out = diff(capsys, tmp_path / "a", tmp_path / "c")
    assert code == 1
    assert verdict(out).startswith("verdict: setup: the gradients differ at step 0 where the forward agrees")
    # the closure's evaluations said, and the remedy for a closure first
    assert "evaluates the optimizer's closure" in out
    capsys.readouterr()
    main(["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--json"])
    remedies = json.loads(capsys.readouterr().out)["verdict"]["remedies"]
    assert remedies[0].startswith("call optimizer.zero_grad() at the start of the closure"), remedies
    assert "different data" not in out  # however many times each run's closure fed the batch


@pytest.mark.parametrize("change, words", [
    (dict(p=0.3), "verdict: setup: the models' layers are built differently: 2 (Dropout).p is 0.3 in B, 0.1 in A"),
    (dict(label_offset=1), "verdict: setup: the loss was given other targets (labels) from step 0"),
    (dict(freeze_at=8), "verdict: setup: 0.* stop getting a gradient in B from step 8"),
])
def test_a_layer_setting_a_label_mapping_or_a_mid_run_freeze_in_one_run_is_named(tmp_path, capsys, change, words):
    """Each invisible to the optimizer's settings and the batches: a Dropout built with another p, labels offset
    by one class before the loss, requires_grad turned off mid-run."""
    L.mlp_run(tmp_path / "a")
    L.mlp_run(tmp_path / "b", **change)
    code, out = diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert verdict(out).startswith(words), out


@pytest.mark.slow  # three processes of 150 steps, ~8 s: the slow pass
def test_an_order_in_the_users_code_is_named_not_kernels(tmp_path, capsys):
    """The model sums its heads over a set of names, whose order is the hash seed's (issue 43): on CPU kernels that
    repeat themselves bitwise the parting is an order in the code, its remedy the code's, not
    use_deterministic_algorithms. The same seed twice agrees."""
    import subprocess
    import sys
    from pathlib import Path

    loop = Path(__file__).with_name("set_order_loop.py")
    for name, seed in (("s1", "1"), ("s2", "2"), ("s1again", "1")):
        done = subprocess.run([sys.executable, str(loop), str(tmp_path / name)], capture_output=True, text=True,
                              env={**__import__("os").environ, "PYTHONHASHSEED": seed}, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    code, out = diff(capsys, tmp_path / "s1", tmp_path / "s1again")
    assert code == 0, out
    code, out = diff(capsys, tmp_path / "s1", tmp_path / "s2")
    assert code == 1
    assert "an order in the code (a set or dict iterated, a hash seed) differs" in verdict(out)
    assert "remedy: iterate in a fixed order in your own code" in out
