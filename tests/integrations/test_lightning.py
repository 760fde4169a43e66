"""``convcheck.integrations.lightning.ConvcheckCallback`` against the real PyTorch Lightning (slow: the
``lightning`` extra, installed by ``.ci/run``): ``examples/watch_lightning.py`` run as a user would, diffed."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest


from convcheck.cli.main import main

pytestmark = pytest.mark.slow  # and skipped where the extra is missing (importorskip in
# the fixtures, so that collecting the fast suite never imports the framework)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "watch_lightning.py"


def diff(capsys, a, b) -> tuple[int, str]:
    code = main(["diff", str(a), str(b), "--no-save"])
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("lightning")
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("lightning")
    example = runpy.run_path(str(EXAMPLE))
    try:
        for name, precision, seed in (("fp32", "fp32", "0"), ("fp32_again", "fp32", "0"), ("bf16", "bf16", "0"),
                                      ("reshuffled", "fp32", "1")):
            mp.setenv("CONVCHECK_PRECISION", precision)
            mp.setenv("CONVCHECK_LOADER_SEED", seed)
            example["main"](str(tmp / name))
    finally:
        mp.undo()
    return tmp


def test_each_optimizer_step_is_recorded_with_its_loss_and_gradients(runs):
    manifest = json.loads((runs / "fp32" / "manifest.json").read_text())
    steps = [json.loads(line) for line in (runs / "fp32" / "steps.jsonl").read_text().splitlines()]
    assert manifest["complete"] and manifest["steps"] == 4 and manifest["optimizer"] == "SGD"
    assert manifest["model"]["class"] == "SmallCNN"
    params = {p["name"] for p in manifest["model"]["parameters"]}
    for s in steps:
        assert s["stepped"] and s["lr"] == [0.001] and s["loss"] > 0
        assert set(s["grad_norms"]) == params  # read after the closure's backward, not before it
        assert s["layers"]["net.0"]["dtype"] == "float32"
    assert len({s["loss"] for s in steps}) == 4 and steps[0]["grad_norms"] != steps[1]["grad_norms"]
    assert [e["step"] for e in manifest["snapshots"]] == [0]


def test_an_accumulated_step_is_one_watched_step_with_its_micro_batches(runs, tmp_path):
    example = runpy.run_path(str(EXAMPLE))
    example["main"](str(tmp_path / "accumulated"), steps=2, accumulate=2)
    steps = [json.loads(line) for line in (tmp_path / "accumulated" / "steps.jsonl").read_text().splitlines()]
    once = [json.loads(line) for line in (runs / "fp32" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(s["stepped"] for s in steps)
    # each micro-batch: the loader's batch, then the forward's input; the same batches as the plain run's 0..3
    assert [s["batch_sha256"] for s in steps] == [once[0]["batch_sha256"] + once[1]["batch_sha256"],
                                                  once[2]["batch_sha256"] + once[3]["batch_sha256"]]
    # the loss Lightning computed: the mean of the two micro-batches' losses at the step's parameters (each
    # handed over divided by 2), recomputed here from the snapshot's parameters and the example's loader
    import torch
    import torch.nn.functional as F

    from convcheck.runformat.reader import open_watched

    snapshot = open_watched(tmp_path / "accumulated").snapshot(0)
    model = example["SmallCNN"]()
    model.load_state_dict({k[len("param/"):]: torch.from_numpy(v) for k, v in snapshot.items() if k.startswith("param/")})
    (x0, y0), (x1, y1), *_ = example["make_loader"]()
    with torch.no_grad():
        expected = (F.cross_entropy(model(x0), y0) + F.cross_entropy(model(x1), y1)) / 2
    assert steps[0]["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_two_float32_runs_agree(runs, capsys):
    code, out = diff(capsys, runs / "fp32", runs / "fp32_again")
    assert code == 0
    assert "verdict: ok: the two watched runs agree within rounding at every aligned step" in out


def test_float32_against_bf16_mixed_agrees_within_bf16s_rounding(runs, capsys):
    """The example's CNN trains alike in float32 and bf16-mixed (losses 15.26, 15.20, 9.57, 3.56 against 15.25,
    15.20, 9.41, 3.57: at most 1.7% apart, a few bfloat16 roundoffs): no finding, and the diff says the two
    compute at different precisions (new-user trial 3: such healthy pairs were blamed as numerics)."""
    code, out = diff(capsys, runs / "fp32", runs / "bf16")
    assert code == 0
    assert "verdict: ok:" in out
    assert "A's layers output float32, B's bfloat16: they agree within the coarser precision's rounding" in out


def test_a_loader_shuffled_with_another_seed_is_named_as_different_data(runs, capsys):
    code, out = diff(capsys, runs / "fp32", runs / "reshuffled")
    assert code == 1
    assert "verdict: setup: the runs did not see the same data: different data from step 0" in out


def test_a_run_that_raised_is_closed_as_stopped_and_diffed_up_to_there(runs, tmp_path, capsys):
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from convcheck.integrations.lightning import ConvcheckCallback

    class Breaks(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("the user's training step failed")
            x, y = batch
            return F.cross_entropy(self.fc(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ConvcheckCallback(out=tmp_path / "broken")])
    with pytest.raises(RuntimeError, match="training step failed"):
        trainer.fit(Breaks(), DataLoader(data, batch_size=8))
    model = trainer.lightning_module
    assert not model.fc._forward_hooks  # the watch's hooks are gone
    manifest = json.loads((tmp_path / "broken" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["steps"] == 2
    assert manifest["stopped"] == {"exception": "RuntimeError", "message": "the user's training step failed",
                                   "step": 2}
    code = main(["diff", str(tmp_path / "broken"), "--judge", "cpu:float64", "--no-save"])
    out, err = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in err, err  # the two steps it recorded are read
    assert "stopped: the run stopped at step 2 with RuntimeError (the user's training step failed)" in out
