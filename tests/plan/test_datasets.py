"""The user's data: factories (Dataset, IterableDataset, iterables of batches), batch structures, digits,
streaming, and the same batches on every arm and on a rerun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convcheck.cli.main import main
from convcheck.errors import UsageError
from convcheck.pipeline import compare
from convcheck.targets.spec import Target

T = Target.parse

USER = Path(__file__).parents[1] / "data" / "user"
DATA, MODELS = f"{USER}/datasets.py", f"{USER}/models.py"
FAST = dict(envelope=1, env_findings=[], batch_size=8)


def _run(data, model=f"{MODELS}:net", targets="cpu,cpu:bf16", steps=4, **kw):
    return compare(model, targets, data=data, steps=steps, **{**FAST, **kw})


def test_a_dataset_with_augmentation_gives_every_arm_and_every_rerun_the_same_batches():
    a = _run(f"{DATA}:dataset", steps=6)
    b = _run(f"{DATA}:dataset", steps=6)
    assert a.batch_hashes == b.batch_hashes and len(set(a.batch_hashes)) == 6
    assert a.data_source == "factory:datasets.dataset"
    # 64 samples, batch 8: the 9th batch starts a second, reshuffled epoch
    c = _run(f"{DATA}:dataset", steps=10)
    assert c.batch_hashes[:6] == a.batch_hashes and len(set(c.batch_hashes)) == 10
    # every arm trained on them: the three arms' first losses agree to their precision
    first = a.training.curves[a.training.curves["step"] == 0].set_index("arm")["loss"]
    assert first["cpu"] == pytest.approx(first["cpu:float64"], rel=1e-6)


def test_workers_give_the_same_batches_on_a_rerun():
    a = _run(f"{DATA}:dataset", steps=3, workers=2)
    b = _run(f"{DATA}:dataset", steps=3, workers=2)
    assert a.batch_hashes == b.batch_hashes


def test_dict_batches_two_inputs_and_a_dict_output():
    r = compare(f"{MODELS}:two_in", "cpu,cpu:amp-bf16", data=f"{DATA}:two_inputs", loss=f"{MODELS}:dict_loss",
                steps=8, lr=0.01, **FAST)
    assert r.verdict.category == "ok", r.verdict.headline
    layers = set(r.parity.layers["layer"])
    assert {"conv", "fc", "aux"} <= layers
    assert r.model.input_shape is None  # the data defines the inputs
    assert r.to_summary()["model"]["input_shape"] is None


@pytest.mark.parametrize("factory, words", [
    ("three_batches", "gave only 3 batches; --steps 5 needs 5"),
    ("changing_shapes", "changed its batch shapes at batch 2"),
    ("unseeded", "different first batch on a second pass"),
    ("broken", "data factory 'datasets.broken' raised OSError: no such shard"),
    ("nothing", "returned NoneType, not a Dataset or an iterable"),
    ("nowhere", "has no data factory 'nowhere'"),
])
def test_bad_data_factories_are_one_line_usage_errors(factory, words):
    with pytest.raises(UsageError, match=words):
        _run(f"{DATA}:{factory}", steps=5)


def test_bad_data_factory_through_the_cli_is_exit_2(capsys):
    code = main(["compare", "--model", f"{MODELS}:net", "--data", f"{DATA}:three_batches", "--steps", "5",
                 "--no-save"])
    err = capsys.readouterr().err
    assert code == 2 and "gave only 3 batches" in err and err.count("\n") == 1


def test_a_callable_data_factory_in_the_api():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]
    r = _run(lambda: batches, steps=4)
    assert len(r.batch_hashes) == 4


@pytest.mark.slow  # ~2.5 s
def test_digits_trains_lenet_on_both_arms():
    pytest.importorskip("sklearn")
    r = compare("lenet", "cpu,cpu:bf16", data="digits", steps=30, lr=3e-3, envelope=0, env_findings=[])
    assert r.data_source == "digits"
    for arm in ("cpu", "cpu:bf16"):
        o = r.training.outcomes[T(arm)]
        assert o.final_loss < 0.5 * o.first_loss, (arm, o)
    assert r.data_stats["y_distinct"] == 10


def test_summary_records_the_batches(tmp_path):
    out = tmp_path / "run"
    main(["compare", "--model", "lenet", "--targets", "cpu,cpu:float64", "--steps", "3", "--batch-size", "4",
          "--envelope", "0", "--out", str(out)])
    data = json.loads((out / "summary.json").read_text())["data"]
    assert data["batches"] == 3 and len(data["batch_sha256"]) == 3 and len(data["all_batches_sha256"]) == 64


_PEAK = """
import resource, sys, torch
import torch.nn as nn
torch.set_num_threads(1)
from convcheck.pipeline import compare
def tiny():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 2))
compare(tiny, "cpu,cpu:float64", steps=int(sys.argv[1]), batch_size=256, envelope=0, input_shape=(1, 28, 28),
        num_classes=2, env_findings=[])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.slow
def test_memory_does_not_grow_with_the_number_of_steps():
    """2,000 batches of 256x1x28x28 float64 would be 3.2 GB held at once; streamed, the peak barely moves."""
    def peak_mib(steps):
        out = subprocess.run([sys.executable, "-c", _PEAK, str(steps)], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1]) / 1024

    short, long = peak_mib(100), peak_mib(2000)
    assert long - short < 100, (short, long)
