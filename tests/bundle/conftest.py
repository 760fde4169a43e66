"""Two small bundles recorded once per session (lenet, 2 steps, batch 4, no envelope): cpu and cpu:bf16."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from convcheck.plan.config import CompareConfig

CFG = dict(steps=2, batch_size=4, envelope=0)


def record(tmp: Path, target: str, name: str, **kw) -> Path:
    from convcheck.bundle.record import record_run

    out = tmp / name
    out.mkdir()
    record_run("lenet", target, CompareConfig(**CFG), out, **kw)
    return out


@pytest.fixture(scope="session")
def bundles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bundles")
    return record(tmp, "cpu", "A"), record(tmp, "cpu:bf16", "B")


@pytest.fixture
def copy_a(bundles, tmp_path):
    """A fresh copy of bundle A to damage."""
    dst = tmp_path / "A"
    shutil.copytree(bundles[0], dst)
    return dst
