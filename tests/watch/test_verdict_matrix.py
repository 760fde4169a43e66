"""A CI-sized slice of the verdict matrix (``benchmarks/verdict_matrix.py``, issue 42): healthy variations and
planted faults, each two watched runs of a small family and ``diff_watched``, the verdict held to the case's truth
(its category, and the cause named in its headline, sub-cause or evidence). ``test_the_fault_manifests`` checks in
plain torch, without convcheck, that each planted fault does what the case claims: a failure there is a bug in the
matrix, not in the diff."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from matrix.cases import KINDS  # noqa: E402
from matrix.families import FAMILIES  # noqa: E402
from verdict_matrix import run_case  # noqa: E402

SLICE = [
    ("mlp", "identical"),  # healthy
    ("cnn", "bf16_autocast"),  # healthy: bf16 autocast, BatchNorm
    ("gru", "fp16_scaler"),  # healthy: float16 autocast with a GradScaler, hidden state carried
    ("gan", "bf16_autocast"),  # healthy: the generator's fakes fed to the watched discriminator are not data
    ("mlp", "no_zero_grad"),
    ("mlp", "term_sign"),  # an auxiliary loss term's sign flipped
    ("gru", "lr_x100"),
    ("resnet", "wd_norms"),  # weight decay on the BatchNorm layers in B only
    ("cnn", "frozen"),  # the backbone never unfrozen
    ("cnn", "label_smoothing"),  # nn.CrossEntropyLoss(label_smoothing=0.1) in B only
    ("mlp", "fp16_overflow"),
    ("cnn", "log_softmax_fp16"),  # torch.log(torch.softmax(.)) in float16: log(0) in the backward
]


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


FAULTS = [c for c in SLICE if KINDS[c[1]].truth != "ok"]


@pytest.mark.parametrize("family,kind", FAULTS, ids=[f"{f}/{k}" for f, k in FAULTS])
def test_the_fault_manifests(family, kind):
    from matrix.loop import train

    k, fam = KINDS[kind], FAMILIES[family]
    k.check(fam, train(fam, k.a), train(fam, k.b))


@pytest.mark.parametrize("family,kind", SLICE, ids=[f"{f}/{k}" for f, k in SLICE])
def test_the_verdict_holds_the_truth(family, kind):
    r = run_case(family, kind, check=False)
    assert r["status"] == "ok", r["error"]
    k = KINDS[kind]
    assert r["category"] == k.truth, f"{family}/{kind}: {r['category']}: {r['headline']}"
    assert r["named"], f"{family}/{kind}: none of {list(k.words)} in: {r['headline']} | {r['evidence']}"
