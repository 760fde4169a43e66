"""Issue 46: remedies are data. ``verify`` picks an action by the remedy's catalogue id, never by its words; the
loss-in-float32 action is found for an autocast float16 target whose loss overflows (its remedy says "run the loss
function ... in float32", which the old word search for "compute the loss" never matched); and nothing in
convcheck/ searches a remedy's text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from convcheck.pipeline import compare
from convcheck.targets.runners.half import AmpFloat16Runner

PACKAGE = Path(__file__).resolve().parents[2] / "convcheck"


class _Sharpened(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x) * 25.0  # sharpened logits, as a temperature of 1/25


def _logit_net():
    return _Sharpened()


def _squared_logit_loss(output, target):
    """A loss as a user writes it: cross-entropy plus a penalty on the squared logits, weighted up front. Under
    autocast the product of float16 logits stays float16 (mul is not one of autocast's float32 ops): logits of 25
    times 25 times 1000 are past float16's 65504, and the loss is Inf from the model's finite output."""
    penalty = (1e3 * output * output).mean()
    return torch.nn.functional.cross_entropy(output.float(), target) + 1e-6 * penalty


@pytest.fixture
def amp_fp16_on_cpu(monkeypatch):
    """autocast float16 with a GradScaler on the CPU (torch >= 2.3 has both there): the amp-fp16 runner as on CUDA."""
    monkeypatch.setattr(AmpFloat16Runner, "devices", ("cpu", "cuda"))
    monkeypatch.setattr(AmpFloat16Runner, "runnable_here", classmethod(lambda cls: ["cpu:amp-fp16"]))


def _check_loss_float32_is_chosen(target: str):
    r = compare(_logit_net, f"cpu,{target}", loss=_squared_logit_loss, optimizer="sgd", lr=0.01, steps=4,
                envelope=0, input_shape=(1, 8, 8), num_classes=10, env_findings=[], verify=True)
    v = r.verdict
    assert v.sub_cause == "non-finite in user code" and "loss function" in v.headline, (v.headline, v.remedies)
    kinds = [a.kind for a in r.verification.attempts]
    assert kinds and kinds[0] == "loss-float32", (kinds, r.verification.line)
    assert any(getattr(rem, "id", None) == "autocast-off-loss" for rem in v.remedies), v.remedies


def test_an_autocast_float16_loss_that_overflows_is_verified_computed_in_float32(amp_fp16_on_cpu):
    _check_loss_float32_is_chosen("cpu:amp-fp16")


@pytest.mark.gpu
def test_an_autocast_float16_loss_that_overflows_on_cuda_is_verified_computed_in_float32():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check_loss_float32_is_chosen("cuda:amp-fp16")


def test_a_remedy_is_its_text_and_carries_its_id_and_fields():
    from convcheck.diagnose.catalogue import Remedy
    from convcheck.diagnose.remedies import AUTOCAST_OFF_LOSS, MASTER_WEIGHTS, only_used_formats

    r = AUTOCAST_OFF_LOSS.remedy(loss="focal")
    assert r == ("run the loss function 'focal' in float32: torch.autocast(device_type, enabled=False) around it "
                 "and .float() on its input")
    assert r.id == "autocast-off-loss" and dict(r.fields) == {"loss": "focal"} and r.text() == str(r)
    assert [c.kind for c in r.entry.actions] == ["loss-float32"]
    assert only_used_formats([MASTER_WEIGHTS], {"float16"})[0].id == "master-weights"
    import pickle
    assert pickle.loads(pickle.dumps(r)).fields == r.fields
    with pytest.raises(AttributeError):
        r.id = "other"
    assert isinstance(Remedy("written", (("text", "x"),)), str)


def test_a_verdicts_json_keeps_the_texts_and_adds_the_ids():
    from convcheck.diagnose.remedies import LOWER_LR_10X
    from convcheck.diagnose.verdict import Verdict

    d = Verdict("setup", "h", remedies=[LOWER_LR_10X, "check the data"]).to_dict()
    assert d["remedies"] == ["lower the learning rate (try 10x smaller)", "check the data"]
    assert d["remedy_ids"] == [{"id": "lower-lr-10x", "fields": {}},
                               {"id": "written", "fields": {"text": "check the data"}}]


# what deciding from a remedy's words looks like: a string searched in the remedies, or a table of their words
_TEXT_SEARCH = [re.compile(p) for p in (
    r"REMEDY_WORDS",
    r"""["'][^"'\n]*["']\s+in\s+\w+\s+for\s+\w+\s+in\s+[^\n]*remed""",  # any("words" in r for r in v.remedies)
    r"""remed\w*(\[[^\]]*\])?\s*\.(lower|find|startswith|endswith|index|count)\(""",  # remedy.lower().find(...)
    r"""["'][^"'\n]*["']\s+in\s+\w*remed""",  # "words" in remedy
    r"""\bin\s+\w+\s+for\s+\w+\s+in\s+\(?[\w.]*remedies""",  # ... in r for r in verdict.remedies
)]


def test_no_remedy_text_is_searched_anywhere_in_convcheck():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if any(p.search(code) for p in _TEXT_SEARCH):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert found == [], "a remedy's words decide something:\n" + "\n".join(found)
