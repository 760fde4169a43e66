"""A PyTorch Lightning run diagnosed with ``convcheck.watch`` (issue 25): run it twice, then diff.

    pip install 'convcheck[lightning]'
    CONVCHECK_PRECISION=fp32 python -m examples.watch_lightning runs/lightning_fp32
    CONVCHECK_PRECISION=bf16 python -m examples.watch_lightning runs/lightning_bf16
    convcheck diff runs/lightning_fp32 runs/lightning_bf16

(``python -m`` from the repository's root: the LightningModule is then importable where ``diff`` runs, and
its float64 replay of the snapshot layers runs too; ``python examples/watch_lightning.py`` diffs without it.)

The only convcheck line is the callback in ``Trainer(callbacks=[...])``. ``CONVCHECK_PRECISION`` picks
Lightning's ``32-true`` or ``bf16-mixed`` (bfloat16 autocast); ``CONVCHECK_LOADER_SEED`` seeds the
loader's shuffle (give the two runs different seeds and diff names the data, not the numerics).
"""

import os
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from convcheck.integrations.lightning import ConvcheckCallback


class SmallCNN(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.001, momentum=0.9)


def make_loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (256, 1, 8, 8), generator=g).float()  # raw 0..255, never normalized
    data = TensorDataset(pixels, torch.randint(0, 10, (256,), generator=g))
    return DataLoader(data, batch_size=32, shuffle=True,
                      generator=torch.Generator().manual_seed(int(os.environ.get("CONVCHECK_LOADER_SEED", "0"))))


def main(out: str, steps: int = 4, accumulate: int = 1) -> None:
    precision = {"fp32": "32-true", "bf16": "bf16-mixed"}[os.environ.get("CONVCHECK_PRECISION", "fp32")]
    L.seed_everything(0, verbose=False)
    loader = make_loader()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=steps, logger=False,
                        accumulate_grad_batches=accumulate,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ConvcheckCallback(out=out, force=True)])          # the convcheck line
    trainer.fit(SmallCNN(), loader)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/lightning")
