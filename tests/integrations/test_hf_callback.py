"""The Hugging Face callback watches the model the Trainer trains (issue 45) and leaves nothing on it. With
``model_init`` the Trainer trains a fresh model; it points its callback handler at it before ``on_train_begin``,
so the model handed over is the one trained (a guard: it held before too). The callback's loss hook was registered
on the model, a bound method of the callback holding the watch: a ``copy.deepcopy`` of the model during training
(an EMA a user's callback keeps) raised ``cannot pickle '_hashlib.HASH'``; now it is a process-wide hook routed by
identity."""

from __future__ import annotations

import copy
import json
import runpy
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # importing transformers and a Trainer run: ~15 s; skipped without the hf extra

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "watch_hf.py"


def _train(out, model_init: bool = False, extra=()):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from convcheck.integrations.hf import ConvcheckCallback

    ex = runpy.run_path(str(EXAMPLE))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, max_steps=3, per_device_train_batch_size=16, learning_rate=0.05, use_cpu=True, seed=0,
            report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, remove_unused_columns=False)
        given = dict(model_init=ex["TinyClassifier"]) if model_init else dict(model=ex["TinyClassifier"]())
        trainer = transformers.Trainer(args=args, train_dataset=ex["RandomTokens"](),
                                       callbacks=[ConvcheckCallback(out=out, force=True), *extra], **given)
        trainer.train()
    return trainer


def _steps(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "steps.jsonl").read_text().splitlines()]


def test_with_model_init_the_model_trained_is_the_one_watched(tmp_path):
    trainer = _train(tmp_path / "run", model_init=True)
    steps = _steps(tmp_path / "run")
    assert len(steps) == 3
    assert all(len(s["batch_sha256"]) == 1 and s["layers"] and s["loss"] is not None for s in steps)
    params = dict(trainer.model.named_parameters())
    assert all(s["grad_norms"] and set(s["grad_norms"]) == set(params) for s in steps)


def test_a_deepcopy_of_the_model_during_training_works_and_carries_no_hook(tmp_path):
    transformers = pytest.importorskip("transformers")
    copies = []

    class Ema(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            copies.append(copy.deepcopy(model))

    _train(tmp_path / "run", extra=[Ema()])
    assert len(copies) == 3 and all(not m._forward_hooks for c in copies for m in c.modules())
    assert len(_steps(tmp_path / "run")) == 3
    assert not torch.nn.modules.module._global_forward_hooks  # the callback's loss hook removed at the end
