"""Issue 34's "Seen", as users write the loops (``recipe_loops.py``): ``convcheck diff`` of two watched runs
reaches compare's verdicts - a recipe difference present at step 0 is ``setup`` (never chance or precision),
bf16 weights that drop their updates are named, a fixed loss scale that overflows the backward gets the
GradScaler remedy, gradients that underflow to exactly zero in one run are named; an optimizer over none of
the model's parameters is refused at the edge."""

from __future__ import annotations

import json

import pytest
import torch

import convcheck
from convcheck.cli.main import main
from convcheck.errors import UsageError

from .recipe_loops import (MLP, accumulation_run, bf16_weights_run, clip_run, dropout_run, eval_run, loss_scale_run,
                           sharp_attention_run, smoothing_run, weight_decay_run)


def diff(capsys, *args) -> tuple[int, dict]:
    code = main(["diff", *map(str, args), "--no-save", "--json"])
    out, _ = capsys.readouterr()
    return code, json.loads(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("core")
    accumulation_run(tmp / "acc")
    accumulation_run(tmp / "acc_undivided", divide=False)
    accumulation_run(tmp / "acc_undivided_bf16", divide=False, bf16=True)
    smoothing_run(tmp / "plain")
    smoothing_run(tmp / "smooth", smooth=True)
    smoothing_run(tmp / "smooth_bf16", smooth=True, bf16=True)
    smoothing_run(tmp / "plain_bf16", bf16=True)
    bf16_weights_run(tmp / "w32", bf16=False)
    bf16_weights_run(tmp / "w16")
    loss_scale_run(tmp / "scaled32", fp16=False)
    loss_scale_run(tmp / "scaled16")
    loss_scale_run(tmp / "scaled16_2e18", scale=2.0**18)
    sharp_attention_run(tmp / "att32", fp16=False)
    sharp_attention_run(tmp / "att16", fp16=True)
    weight_decay_run(tmp / "decay")
    weight_decay_run(tmp / "decay_bf16", bf16=True)
    weight_decay_run(tmp / "decay_meant", weight_decay=5e-4)
    clip_run(tmp / "noclip")
    clip_run(tmp / "clip", max_norm=0.5)
    eval_run(tmp / "train_again")
    eval_run(tmp / "stays_eval", forget_train=True)
    dropout_run(tmp / "drop1", seed=1)
    dropout_run(tmp / "drop2", seed=2)
    return tmp


def test_accumulation_that_forgets_to_divide_is_a_loss_scale_not_nondeterminism(runs, capsys):
    code, d = diff(capsys, runs / "acc", runs / "acc_undivided")
    assert d["schema"] == "convcheck.watch-diff/1"
    v = d["verdict"]
    assert code == 1 and v["category"] == "setup" and v["sub_cause"] == "loss scale"
    assert v["headline"].startswith("the runs scale the loss differently: at step 0, before any update, with the "
                                    "same weights and batch, B's gradients are 4x A's for every parameter")
    assert "loss / accumulation_steps" in v["remedies"][0]
    assert "deterministic" not in " ".join(v["remedies"])


def test_the_same_forgotten_division_in_bf16_is_still_the_recipe_not_precision(runs, capsys):
    code, d = diff(capsys, runs / "acc", runs / "acc_undivided_bf16")
    v = d["verdict"]
    assert code == 1 and v["category"] == "setup", v["headline"]
    assert "at step 0, before any update" in v["headline"] and "4x A's" in v["headline"]


def test_label_smoothing_and_class_weights_on_one_side_are_a_different_loss(runs, capsys):
    for other in ("smooth", "smooth_bf16"):
        code, d = diff(capsys, runs / "plain", runs / other)
        v = d["verdict"]
        # the loss is a function of the script's (F.cross_entropy(..., label_smoothing=, weight=)): named as a
        # module's setting is, the first that differs
        assert code == 1 and v["category"] == "setup" and v["sub_cause"] == "loss function", (other, v["headline"])
        assert v["headline"] == "different loss functions: CrossEntropyLoss's label_smoothing is 0.3 in B, 0.0 in A"
        assert "label_smoothing=" in v["remedies"][0]


def test_the_same_recipe_in_bf16_stays_ok(runs, capsys):
    code, d = diff(capsys, runs / "plain", runs / "plain_bf16")
    assert code == 0 and d["verdict"]["category"] == "ok", d["verdict"]["headline"]
    assert d["pair_findings"] == []


def test_bf16_weights_under_plain_sgd_lose_their_updates(runs, capsys):
    code, d = diff(capsys, runs / "w32", runs / "w16")
    v = d["verdict"]
    assert code == 1 and v["category"] == "numerics" and v["sub_cause"] == "small updates lost" and v["target"] == "B"
    assert "master weights" in v["remedies"][0]
    assert [s["kind"] for s in d["own_findings"][1]].count("small updates lost") == 1
    assert not [s for s in d["own_findings"][0] if s["kind"] == "small updates lost"]
    code = main(["diff", str(runs / "w16"), "--judge", "cpu:float64", "--no-save", "--json"])
    alone = json.loads(capsys.readouterr()[0])["verdict"]
    assert code == 1 and alone["sub_cause"] == "small updates lost", alone["headline"]


def test_a_fixed_loss_scale_that_overflows_float16_gets_the_grad_scaler_remedy(runs, capsys):
    code, d = diff(capsys, runs / "scaled32", runs / "scaled16")
    v = d["verdict"]
    assert code == 1 and v["category"] == "numerics" and v["sub_cause"] == "loss scale overflow"
    assert v["headline"].startswith("B's scaled backward overflows at step 0: gradient into fc3's output is Inf "
                                    "while the loss itself is finite")
    assert "GradScaler" in v["remedies"][0]
    assert not any("compute the loss in float32" in r for r in v["remedies"])
    code = main(["diff", str(runs / "scaled16"), "--judge", "cpu:float64", "--no-save", "--json"])
    alone = json.loads(capsys.readouterr()[0])["verdict"]
    assert code == 1 and alone["sub_cause"] == "loss scale overflow"


def test_a_smaller_fixed_scale_that_overflows_only_a_parameters_gradient_is_named_at_its_step(runs, capsys):
    """New-user trial 6: at 2**18 only fc3.bias's gradient overflows (inside the bias reduction; every module's
    output gradient finite), the weights go NaN in that step, and the watch's producer is the next forward: the
    verdict blamed step 1's forward with the attention remedy. The gradient norms show it at step 0."""
    code, d = diff(capsys, runs / "scaled32", runs / "scaled16_2e18")
    v = d["verdict"]
    assert code == 1 and v["sub_cause"] == "loss scale overflow", v["headline"]
    assert v["headline"].startswith("B's scaled backward overflows at step 0: the gradient of fc3.")
    assert "GradScaler" in v["remedies"][0] and not any("sqrt(d)" in r for r in v["remedies"])


def test_float16_gradients_that_underflow_to_zero_are_named(runs, capsys):
    code, d = diff(capsys, runs / "att32", runs / "att16")
    v = d["verdict"]
    assert code == 1 and v["category"] == "numerics" and v["sub_cause"] == "gradient underflow", v["headline"]
    assert v["target"] == "B" and v["layer"].startswith("att.")
    assert "exactly zero" in v["headline"] and "GradScaler" in v["remedies"][0]


def test_an_optimizer_over_none_of_the_models_parameters_is_refused(tmp_path):
    model, other = MLP(), MLP()
    with pytest.raises(UsageError, match="holds none of the model's parameters"):
        convcheck.watch(model, torch.optim.SGD(other.parameters(), lr=0.1), out=tmp_path / "run")
    with pytest.raises(UsageError, match="not a torch.optim.Optimizer"):
        convcheck.watch(model, "sgd", out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_compares_training_detectors_run_on_a_watched_run(runs, capsys):
    """A weight decay typed as 5e-1 where 5e-4 was meant: the run does not converge, and compare's detector
    names why - alone against the judge, and as the pair's verdict when both runs have it."""
    code = main(["diff", str(runs / "decay"), "--judge", "cpu:float64", "--no-save", "--json"])
    d = json.loads(capsys.readouterr()[0])
    v = d["verdict"]
    assert code == 1 and v["category"] == "setup" and v["sub_cause"] == "weight decay too strong", v["headline"]
    assert "lr x weight_decay = 0.05" in v["headline"] and "1e-4 or less" in v["remedies"][0]
    assert [s["kind"] for s in d["own_findings"]].count("weight decay too strong") == 1
    code, d = diff(capsys, runs / "decay", runs / "decay_bf16")
    assert code == 1 and d["verdict"]["headline"].startswith("both runs fail on their own: weight decay too strong")
    code = main(["diff", str(runs / "decay_meant"), "--judge", "cpu:float64", "--no-save", "--json"])
    assert code == 0, json.loads(capsys.readouterr()[0])["verdict"]["headline"]


def test_a_run_that_recorded_no_step_is_refused_not_ok(runs, tmp_path, capsys):
    """Issue 35: a loop that never called optimizer.step() recorded 0 steps; diffing it was 'ok'."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=tmp_path / "empty"):
        for _ in range(3):
            model(torch.randn(4, 20)).sum().backward()  # the user forgot opt.step()
    for args in (["diff", str(tmp_path / "empty"), str(runs / "acc")], ["diff", str(tmp_path / "empty"), "--judge",
                                                                         "cpu:float64"]):
        code = main([*args, "--no-save"])
        err = capsys.readouterr().err
        assert code == 2 and "recorded no step: the loop never ended a step: no optimizer.step()" in err, err


@pytest.mark.parametrize("loss, words", [("abc", "got str 'abc'"), (torch.ones(3), "a tensor of shape [3]"),
                                         (object(), "got object")])
def test_w_step_refuses_a_loss_it_cannot_read_naming_w_step(tmp_path, loss, words):
    model = MLP()
    with convcheck.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), out=tmp_path / "run") as w:
        with pytest.raises(UsageError, match=r"w\.step\(loss\) takes") as err:
            w.step(loss)
    assert words in str(err.value)


def test_two_watches_started_at_once_on_one_folder_the_second_is_refused(tmp_path, monkeypatch):
    """Issue 35: two processes on the same empty folder both wrote into it (steps mixed). The folder is claimed
    before anything is written; the second is refused in one line and the first's record is whole."""
    import convcheck.watch.recorder as recorder
    from convcheck.runformat.reader import open_watched

    out = tmp_path / "run"
    out.mkdir()
    first, second = MLP(), MLP()
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    with convcheck.watch(first, opt, out=out) as w:
        # the second found the folder empty too (its check ran before the first claimed it) ...
        monkeypatch.setattr(recorder, "prepare_out", lambda folder, force: folder)
        late = convcheck.watch(second, torch.optim.SGD(second.parameters(), lr=0.1), out=out)
        with pytest.raises(UsageError, match="was claimed by another watched run starting at the same time"):
            late.__enter__()  # ... and is refused when it claims it
        monkeypatch.undo()
        loss = torch.nn.functional.cross_entropy(first(torch.randn(4, 20)), torch.randint(0, 5, (4,)))
        loss.backward()
        opt.step()
        w.step(loss)
    assert len(open_watched(out).steps) == 1


def test_clipping_in_one_run_only_is_setup_not_nondeterminism(runs, capsys):
    """New-user trial 6: clip_grad_norm_(0.5) in B only was 'nondeterminism' with the deterministic remedy."""
    code, d = diff(capsys, runs / "noclip", runs / "clip")
    v = d["verdict"]
    assert code == 1 and v["category"] == "setup" and v["sub_cause"] == "gradient clipping", v["headline"]
    assert v["headline"].startswith("B clips its gradients at norm 0.5 and A does not")
    assert "clip_grad_norm_" in v["remedies"][0]


def test_training_on_in_eval_mode_after_validation_is_named(runs, capsys):
    """New-user trial 6: model.train() forgotten after a validation pass: the watch recorded nothing of those steps
    and diff said 'different data'. Now the step is marked and the verdict names eval mode, alone and in a pair."""
    code, d = diff(capsys, runs / "train_again", runs / "stays_eval")
    v = d["verdict"]
    assert code == 1 and v["category"] == "setup" and v["sub_cause"] == "eval mode", v["headline"]
    assert v["headline"].startswith("B trains with the model in eval mode from step 5 and A does not")
    assert "model.train()" in v["remedies"][0] and "DataLoader" not in " ".join(v["remedies"])
    code = main(["diff", str(runs / "stays_eval"), "--judge", "cpu:float64", "--no-save", "--json"])
    alone = json.loads(capsys.readouterr()[0])["verdict"]
    assert code == 1 and alone["headline"].startswith("the run trains with the model in eval mode from step 5")
    code, d = diff(capsys, runs / "train_again", runs / "train_again")
    assert code == 0, d["verdict"]["headline"]  # a validation pass under no_grad is no finding


def test_dropout_masks_of_two_seeds_are_named_with_the_seed_remedy(runs, capsys):
    """New-user trial 6: two seeds' dropout masks got the deterministic-algorithms remedy, which cannot help."""
    code, d = diff(capsys, runs / "drop1", runs / "drop2")
    v = d["verdict"]
    assert code == 1 and v["category"] == "nondeterminism" and v["sub_cause"] == "random layer", v["headline"]
    assert v["headline"].startswith("the runs part at step 0 in net.2, a random layer (Dropout)")
    assert v["remedies"][0].startswith("the model's random layers (net.2) draw random numbers: seed both runs")


def test_an_embedding_is_replayed_on_its_recorded_indices(tmp_path, capsys):
    """New-user trial 6: every nn.Embedding said 'its recorded inputs do not re-run it (TypeError)'; then it was
    skipped (its integer indices were not kept); since issue 43 its indices are recorded and it is replayed."""
    from .recipe_loops import embedding_run

    embedding_run(tmp_path / "emb")
    code = main(["diff", str(tmp_path / "emb"), "--judge", "cpu:float64", "--no-save"])
    out = capsys.readouterr()[0]
    assert code == 0, out
    assert "TypeError" not in out and "2 layer calls at step 0 replayed: all within their floors" in out
    assert "the judge checked 2 of 2 layers (snapshot step 0)" in out
