"""The synthetic data is the same bits at any thread count (issue 44): every zoo model's first batch hashes
alike at 1, 2 and 4 intra-op threads, and ``--threads N`` is in force before the first batch is made."""

from __future__ import annotations

import pytest
import torch

from convcheck.batch import batch_hash
from convcheck.plan.data_sources import open_data
from reference_models import get_spec, list_models

COUNTS = (1, 2, 4)


@pytest.fixture
def threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _first_hash(name: str, threads: int, data=None, batch_size: int = 2) -> str:
    spec = get_spec(name)
    torch.set_num_threads(threads)
    stream = open_data(data, input_shape=spec.input_shape, num_classes=spec.num_classes, batch_size=batch_size,
                       steps=1, seed=0, task=spec.task)
    inputs, target = stream.first()
    return batch_hash(inputs, target)


@pytest.mark.parametrize("name", list_models())
def test_first_batch_same_bits_at_every_thread_count(name, threads_kept):
    hashes = {n: _first_hash(name, n) for n in COUNTS}
    assert len(set(hashes.values())) == 1, hashes


def test_a_batch_of_many_classes_same_bits_at_every_thread_count(threads_kept):
    # 16 samples of a 1000-class model: several 224x224 prototypes, stacked and noised
    hashes = {n: _first_hash("resnet18", n, batch_size=16) for n in COUNTS}
    assert len(set(hashes.values())) == 1, hashes


def test_digits_same_bits_at_every_thread_count(threads_kept):
    pytest.importorskip("sklearn")
    hashes = {n: _first_hash("cifar_cnn", n, data="digits", batch_size=4) for n in COUNTS}
    assert len(set(hashes.values())) == 1, hashes


def test_generation_leaves_the_thread_count(threads_kept):
    _first_hash("resnet18", 2)
    assert torch.get_num_threads() == 2


def test_threads_option_in_force_before_the_first_batch(monkeypatch, threads_kept):
    """compare(threads=N) makes the first batch at N threads, not at the caller's count."""
    import convcheck
    from convcheck.plan import stream

    seen = []
    first = stream.DataStream.first

    def spy(self):
        seen.append(torch.get_num_threads())
        return first(self)

    monkeypatch.setattr(stream.DataStream, "first", spy)
    torch.set_num_threads(2)
    convcheck.compare("lenet", "cpu,cpu:float64", steps=2, envelope=0, batch_size=4, threads=1, verify=False)
    assert seen and set(seen) == {1}, seen
    assert torch.get_num_threads() == 2


def _thread_dependent_batches():
    """A user's data whose bits follow the thread count (as a threaded kernel's would)."""
    g = torch.Generator().manual_seed(0)
    shift = torch.get_num_threads() * 1e-3
    for _ in range(50):
        yield torch.randn(4, 1, 28, 28, generator=g) + shift, torch.randint(10, (4,), generator=g)


def test_a_measured_count_makes_the_first_batch_again_at_that_count(monkeypatch, threads_kept):
    """The count measured on the first batch differs from the one it was made at: the first batch is made again,
    so data whose bits follow the count is one batch throughout (not 'a different first batch')."""
    import convcheck
    from convcheck import stages
    from convcheck.plan.threads import ThreadChoice

    monkeypatch.setattr(stages, "given_choice", lambda requested: None)
    monkeypatch.setattr(stages, "measure_choice", lambda steps, default: ThreadChoice(1, "measured faster than 2",
                                                                                       "measured"))
    torch.set_num_threads(2)
    result = convcheck.compare("lenet", "cpu,cpu:float64", data=_thread_dependent_batches, steps=2, envelope=0,
                               batch_size=4, verify=False)
    assert result.threads.threads == 1 and result.verdict is not None
    assert torch.get_num_threads() == 2
