"""Small updates lost (bf16/fp16 weights): a warm-up's rising steps do not count, and a short run whose target
tracks the judge is no numerics verdict on this symptom alone (a new user's 4-step warm-up run was)."""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

from convcheck.diagnose.detectors import training as S

BF16_U = 2.0 ** -8


def _curves(lr, ratio, arm="cpu:bf16"):
    n = len(lr)
    return pd.DataFrame(dict(arm=[arm] * n, step=range(n), lr=lr, update_ratio=ratio))


def test_warmup_steps_do_not_count():
    # four rising steps with tiny updates (most of the run), then the peak: the updates there are well above u
    c = _curves([0.002, 0.004, 0.006, 0.008, 0.01, 0.0099], [1e-4, 2e-4, 3e-4, 4e-4, 2e-2, 2e-2])
    assert S.lost_updates(c, "cpu:bf16", BF16_U, True) is None


def test_updates_below_u_after_the_warmup_are_still_lost():
    c = _curves([0.0005, 0.001, 0.001, 0.001, 0.001, 0.001], [1e-3, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4])
    s = S.lost_updates(c, "cpu:bf16", BF16_U, True)
    assert s is not None and s.name == S.SMALL_UPDATES_LOST and s.value == 1e-4
    # a constant rate: every step counts
    assert S.lost_updates(_curves([1e-4] * 4, [1e-5] * 4), "cpu:bf16", BF16_U, True).value == 1e-5


class Net(nn.Module):  # the new user's model (nu5 s6_project/nets.py)
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(16 * 16, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def focal(output, target, gamma=2.0):
    logp = F.log_softmax(output.float(), dim=1)
    logpt = logp.gather(1, target[:, None]).squeeze(1)
    return (-(1 - logpt.exp()) ** gamma * logpt).mean()


def test_a_four_step_warmup_run_that_tracks_the_judge_is_not_numerics():
    from convcheck.pipeline import compare

    r = compare(Net, "cpu,cpu:bf16", input_shape=(1, 28, 28), num_classes=10, loss=focal, optimizer="sgd",
                lr=0.01, momentum=0.9, nesterov=True, schedule="cosine", warmup=3, steps=4, batch_size=16,
                envelope=1, env_findings=[], verify=False)
    c = r.training.curves
    bf16 = c[c["arm"] == "cpu:bf16"]
    assert (bf16["update_ratio"] < BF16_U).any()  # the symptom's numbers are there, as the user saw
    v = r.verdict
    assert v.category == "ok" and S.SMALL_UPDATES_LOST not in (v.symptoms or ()), (v.headline, v.evidence)
    assert r.ok
