"""Lightning with two optimizers (issue 45): a GAN under manual optimization (``automatic_optimization = False``),
generator and discriminator each stepping its own optimizer every batch. Before, the callback watched the first
optimizer only (a line on stderr said so): the discriminator's steps were not the run's and its gradient norms
were missing. Now every optimizer of the trainer is watched (``convcheck.watch(optimizers=[...])``): one batch is
one step with both models' gradient norms, the losses the step returned, and two runs diff ``ok``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from convcheck.cli.main import main

pytestmark = pytest.mark.slow  # importing lightning and two Trainer runs: ~15 s; skipped without the extra


def _gan_run(out) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from convcheck.integrations.lightning import ConvcheckCallback

    class Gan(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
            self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            z = torch.randn(real.shape[0], 4, generator=self.noise)
            fake = self.G(z)
            ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
            d_loss = (F.binary_cross_entropy_with_logits(self.D(real), ones)
                      + F.binary_cross_entropy_with_logits(self.D(fake.detach()), zeros))
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            g_loss = F.binary_cross_entropy_with_logits(self.D(fake), ones)
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            return g_loss + d_loss

        def configure_optimizers(self):
            return (torch.optim.Adam(self.G.parameters(), lr=1e-3),
                    torch.optim.Adam(self.D.parameters(), lr=1e-3))

    torch.manual_seed(0)
    model = Gan()
    model.noise = torch.Generator().manual_seed(2)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ConvcheckCallback(out=str(out), force=True)])
    trainer.fit(model, loader)


def test_a_gan_under_manual_optimization_records_both_optimizers(tmp_path, capsys):
    _gan_run(tmp_path / "a")
    _gan_run(tmp_path / "b")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    steps = [json.loads(line) for line in (tmp_path / "a" / "steps.jsonl").read_text().splitlines()]
    assert manifest["optimizer"] == "Adam+Adam"
    assert len(steps) == 3  # max_steps counts every optimizer step in manual optimization: 6 are 3 batches
    params = {p["name"] for p in manifest["model"]["parameters"]}
    assert {n.split(".")[0] for n in params} == {"G", "D"}
    for s in steps:
        assert s["stepped"] and set(s["grad_norms"]) == params and s["loss"] is not None
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--no-save"]) == 0
    assert "verdict: ok" in capsys.readouterr().out
