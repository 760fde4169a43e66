"""A DDP rank diffed against one process with the same global batch (issue 45's acceptance): ``ok``, saying what
was compared - the averaged gradients, the parameters, the learning rates, the recipe - and that the batches,
losses and activations are each rank's share. Before, the pair was ``setup: the runs did not see the same data``.

``ddp_global_batch.py`` runs as 2 gloo ranks (two processes started here with torchrun's variables, as the
one-rank fixture of ``test_watch_ddp.py`` does: never a process group in the pytest process) and as one process,
at once: ~13 s on two shared cores, the slow pass. The fast test makes rank 0's record in this process: its share's
forward and the other share's, the mean of their losses backward - the gradients DDP's all-reduce averages -
with the manifest saying rank 0 of 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck
from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrapped

LOOP = Path(__file__).resolve().parent / "ddp_global_batch.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``ddp`` (2 ranks, DDP), ``unaveraged`` (2 ranks, no DDP wrapper); ``single``, ``single_lr`` (lr 0.2) and
    ``half`` (one share's batch) in one process."""
    tmp = tmp_path_factory.mktemp("global_batch")
    base = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    ddp_args = [f"{tmp / 'ddp'}", f"{tmp / 'unaveraged'}:unaveraged"]
    procs = [subprocess.Popen([sys.executable, str(LOOP), *ddp_args], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    single = dict(os.environ, OMP_NUM_THREADS="1")
    single.pop("WORLD_SIZE", None)
    procs.append(subprocess.Popen([sys.executable, str(LOOP), f"{tmp / 'single'}", f"{tmp / 'single_lr'}:lr",
                                   f"{tmp / 'half'}:half"], env=single, cwd=tmp, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
    for p in procs:
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("ddp_global_batch.py did not finish in 300 s")
        assert p.returncode == 0, err[-3000:]
    return tmp


def diff(capsys, *args) -> tuple[int, str]:
    code = main(["diff", *map(str, args), "--no-save"])
    return code, unwrapped(capsys.readouterr().out)


@pytest.mark.slow  # the gloo fixture: ~13 s
def test_a_ddp_rank_against_one_process_on_the_same_global_batch_is_ok_and_says_what_it_compared(runs, capsys):
    capsys.readouterr()
    code, out = diff(capsys, runs / "ddp" / "rank0", runs / "single")
    assert code == 0, out
    assert "A = " in out and "(rank 0 of 2, 4 steps)" in out and "(one process, 4 steps)" in out
    assert ("not compared: the batches, the losses and the layers' activations (a rank's are its share of the "
            "global batch)") in out
    assert "A's batch has 8 rows (x 2 ranks = 16), B's 16 (x 1 = 16): the same global batch size" in out
    assert "gradients: the norms agree within 0.0001 (relative) at every one of 4 steps" in out
    assert "snapshots: the parameters and gradients agree element by element within 0.0001 at steps 0, 3" in out
    assert "verdict: ok: the runs agree where DDP makes a rank equal to a run on the same global batch" in out
    assert "different data" not in out
    # either order; rank 1 too
    assert diff(capsys, runs / "single", runs / "ddp" / "rank1")[0] == 0


@pytest.mark.slow
def test_a_planted_learning_rate_is_still_found(runs, capsys):
    capsys.readouterr()
    code, out = diff(capsys, runs / "ddp" / "rank0", runs / "single_lr")
    assert code == 1
    assert "verdict: setup: different learning rates: B's learning rate is 0.2 where A's is 0.1 from step 0" in out


@pytest.mark.slow
def test_gradients_never_averaged_part_at_step_0(runs, capsys):
    capsys.readouterr()
    code, out = main(["diff", str(runs / "unaveraged" / "rank0"), str(runs / "single"), "--no-save", "--json"]), \
        capsys.readouterr().out
    assert code == 1
    v = json.loads(out)["verdict"]
    assert v["category"] == "setup" and v["sub_cause"] == "global batch"
    assert v["headline"].startswith("the averaged gradients part from the other run's at step 0, where DDP on the "
                                    "same global batch makes them equal: the global batch differs")
    assert any("wrap the model in DistributedDataParallel" in r for r in v["remedies"])


@pytest.mark.slow
def test_one_process_on_one_shares_batch_is_not_the_global_batch(runs, capsys):
    capsys.readouterr()
    code, out = diff(capsys, runs / "ddp" / "rank0", runs / "half")
    assert code == 1
    assert "B's 8 (x 1 = 8): not the same global batch size" in out
    assert ("verdict: setup: the averaged gradients part from the other run's at step 0, where DDP on the same "
            "global batch makes them equal: the two runs do not train on the same global batch size") in out


@pytest.mark.slow
def test_the_json_says_what_was_compared(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs / "ddp" / "rank0"), str(runs / "single"), "--no-save", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world"] == ["rank 0 of 2", "one process"] and doc["verdict"]["category"] == "ok"
    assert doc["not_compared"].startswith("the batches, the losses")


def _emulated(out, rank_of_two: bool, lr: float = 0.1) -> None:
    """The loop of ``ddp_global_batch.py`` in this process: one process on the global batch, or rank 0 of 2 (the
    mean of the two shares' losses backward: DDP's averaged gradients; rank 0's share called first)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out, snapshot_steps=(0, 3)) as w:
        for _ in range(4):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            if rank_of_two:
                loss = (F.cross_entropy(model(x[:8]), y[:8]) + F.cross_entropy(model(x[8:]), y[8:])) / 2
            else:
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    if rank_of_two:
        manifest = out / "manifest.json"
        m = json.loads(manifest.read_text())
        m["distributed"] = {"rank": 0, "world_size": 2, "backend": "gloo"}
        manifest.write_text(json.dumps(m))


def test_rank_0_of_two_made_in_this_process_against_one_process(tmp_path, capsys):
    _emulated(tmp_path / "rank0", True)
    _emulated(tmp_path / "single", False)
    _emulated(tmp_path / "single_lr", False, lr=0.2)
    capsys.readouterr()
    code, out = diff(capsys, tmp_path / "rank0", tmp_path / "single")
    assert code == 0, out
    assert "A's batch has 8 rows (x 2 ranks = 16), B's 16 (x 1 = 16): the same global batch size" in out
    assert "verdict: ok: the runs agree where DDP makes a rank equal to a run on the same global batch" in out
    code, out = diff(capsys, tmp_path / "rank0", tmp_path / "single_lr")
    assert code == 1
    assert "verdict: setup: different learning rates: B's learning rate is 0.2 where A's is 0.1 from step 0" in out
