"""The watch's quick start (README.md): a complete training script with the two lines that record it, run once in
float32 and once under bfloat16 autocast, then diffed.

    python -m examples.watch_quickstart runs/fp32
    python -m examples.watch_quickstart runs/bf16 bf16
    convcheck diff runs/fp32 runs/bf16

A small CNN learning 4 classes of 64 random images (each class a colour tint), 12 optimizer steps; nothing to
download. Run it as a module (``python -m``) from the repository's root so that ``convcheck diff`` can import
``Net`` for its float64 replay.
"""

import sys

import torch
import torch.nn as nn

import convcheck


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main(out: str, precision: str = "fp32") -> None:
    convcheck.seed_everything(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 4, (64,), generator=g)
    images = torch.randn(64, 3, 16, 16, generator=g) + torch.randn(4, 3, 1, 1, generator=g)[labels]  # a tint a class
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=16,
                                         shuffle=True, generator=torch.Generator().manual_seed(2))

    with convcheck.watch(model, optimizer, out=out, force=True) as w:      # 1: around the loop
        for epoch in range(3):
            for x, y in loader:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                w.step(loss)                                               # 2: records the loss (optional)
    print(f"{out}: {precision}, final loss {loss.item():.4f}")


if __name__ == "__main__":
    main(*sys.argv[1:3]) if len(sys.argv) > 1 else main("runs/quickstart")
