"""An LSTM fed packed sequences (``pack_padded_sequence``, the usual way to batch sequences of several lengths):
the judge replays the LSTM's call with its ``PackedSequence`` rebuilt, so a bf16 run of it is checked - not left
``inconclusive`` for an argument the record could not describe."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence

import convcheck
from convcheck.analysis.diff import diff_watched, judge_watched


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 24, batch_first=True)
        self.head = nn.Linear(24, 3)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


def _run(out, bf16: bool, steps: int = 12) -> None:
    convcheck.seed_everything(0)
    model = Tagger()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(4)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            lengths = torch.randint(3, 10, (8,), generator=g)
            x = torch.randn(8, 9, 6, generator=g)
            y = (x[:, 0, 0] > 0).long() + (x[:, 0, 1] > 0).long()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = nn.functional.cross_entropy(model(x, lengths), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def test_the_judge_replays_an_lstm_given_packed_sequences(tmp_path):
    _run(tmp_path / "run", bf16=False)
    j = judge_watched(tmp_path / "run", "cpu:float64")
    assert "lstm" in j.replay.checked, j.replay.unchecked
    assert not j.replay.flagged
    assert j.verdict.category == "ok", j.verdict.headline


def test_a_bf16_pair_of_it_is_judged_not_left_inconclusive(tmp_path):
    _run(tmp_path / "fp32", bf16=False)
    _run(tmp_path / "bf16", bf16=True)
    d = diff_watched(tmp_path / "fp32", tmp_path / "bf16")
    assert d.verdict.category == "ok", d.verdict.headline
    assert all("lstm" in r.checked for r in d.replays)
