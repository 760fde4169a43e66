"""``convcheck.watch`` under torch.distributed: each rank writes ``out/rank<k>/``; ``convcheck diff`` of two
DDP runs diffs rank by rank and, within each run, every rank against rank 0 where DDP makes them equal
(parameters, averaged gradients, learning rates), never calling the ranks' sharded batches a data difference.
The slow tests launch ``ddp_loop.py`` with torchrun (2 processes, gloo), as a user launches a DDP script."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrapped

LOOP = Path(__file__).resolve().parent / "ddp_loop.py"


def diff(capsys, *args) -> tuple[int, str, str]:
    """The diff's exit code, its output with the wrapped prose joined back (``verdict_lines.unwrapped``), stderr."""
    code = main(["diff", *map(str, args), "--no-save"])
    out, err = capsys.readouterr()
    return code, unwrapped(out), err


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """``ddp_loop.py`` run as one rank of a gloo world of one (``env://`` on 127.0.0.1, as torchrun sets it),
    in its own process: two correct watched runs, ``a`` and ``b``. Never in the pytest process: a process
    group made there (file rendezvous, DDP wrapper) hung CI's suite at this test until its time limit."""
    tmp = tmp_path_factory.mktemp("one_rank")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        done = subprocess.run([sys.executable, str(LOOP), f"{tmp / 'a'}:none", f"{tmp / 'b'}:none"],
                              capture_output=True, text=True, timeout=180, env=env, cwd=tmp)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a one-rank gloo run of ddp_loop.py did not finish in 180 s: {exc.stderr!r:.2000}")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp


def ddp_copy(one_rank: Path, tmp_path: Path) -> Path:
    """A copy of the one-rank run ``a`` that a test may change."""
    shutil.copytree(one_rank / "a", tmp_path / "ddp")
    return tmp_path / "ddp"


@pytest.mark.slow  # ~4 s: a gloo process group
def test_under_a_process_group_the_watch_writes_its_rank_folder(one_rank, capsys):
    assert sorted(os.listdir(one_rank / "a")) == ["rank0"]
    manifest = json.loads((one_rank / "a" / "rank0" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["distributed"] == {"rank": 0, "world_size": 1, "backend": "gloo"}
    code, out, _ = diff(capsys, one_rank / "a", one_rank / "b")
    assert code == 0
    assert "DDP runs: A = " in out and "1 ranks each, diffed rank by rank" in out
    assert "verdict: ok: every rank agrees with its counterpart within rounding" in out


@pytest.mark.slow  # the one-rank gloo fixture: ~4 s
def test_a_ddp_run_against_a_single_process_run_or_a_gap_in_the_ranks_is_one_line(one_rank, tmp_path, capsys):
    ddp_copy(one_rank, tmp_path)
    code, _, err = diff(capsys, tmp_path / "ddp", tmp_path / "ddp" / "rank0")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "is a DDP run (one folder per rank)" in err
    (tmp_path / "ddp" / "rank0").rename(tmp_path / "ddp" / "rank1")
    code, _, err = diff(capsys, tmp_path / "ddp", tmp_path / "ddp")
    assert code == 2 and "rank0/ is missing" in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """One torchrun launch of 2 gloo ranks: a correct run twice, one with no_sync left on, one unsharded."""
    tmp = tmp_path_factory.mktemp("ddp")
    runs = {"good": "none", "good_again": "none", "no_sync": "no_sync", "unsharded": "unsharded",
            "epochs": "epochs", "no_set_epoch": "no_set_epoch", "ordered": "ordered"}
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def launch():
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(LOOP), *(f"{tmp / name}:{bug}"
                                            for name, bug in runs.items())],
                              capture_output=True, text=True, timeout=600, env=env, cwd=tmp)

    done = launch()
    if done.returncode != 0 and "terminate called without an active exception" in done.stderr:
        # gloo's teardown race on a loaded machine (a rank aborts in destroy_process_group after its work):
        # torch's, not the watch's; one fresh launch into fresh folders
        for name in runs:
            shutil.rmtree(tmp / name, ignore_errors=True)
        done = launch()
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp


@pytest.mark.slow
def test_two_correct_ddp_runs_agree_rank_by_rank_and_across_ranks(ddp_runs, capsys):
    assert sorted(os.listdir(ddp_runs / "good")) == ["rank0", "rank1"]
    code, out, _ = diff(capsys, ddp_runs / "good", ddp_runs / "good_again")
    assert code == 0
    assert "rank 0: ok:" in out and "rank 1: ok:" in out
    assert "across the ranks of A: the parameters, averaged gradients and learning rates agree at every step" in out
    assert "verdict: ok: every rank agrees with its counterpart within rounding" in out


@pytest.mark.slow
def test_two_ranks_of_one_run_are_not_a_data_difference(ddp_runs, capsys):
    code, out, _ = diff(capsys, ddp_runs / "good" / "rank0", ddp_runs / "good" / "rank1")
    assert code == 0
    assert "different data" not in out
    assert "their different batches are the sampler's sharding, not a data difference" in out


@pytest.mark.slow
def test_gradients_never_averaged_part_the_ranks(ddp_runs, capsys):
    code, out, _ = diff(capsys, ddp_runs / "good", ddp_runs / "no_sync", "--json")
    assert code == 1
    result = json.loads(out)
    v = result["verdict"]
    assert v["category"] == "setup" and v["target"] == "B" and v["sub_cause"] == "ranks not synchronised"
    assert v["headline"] == "in B, rank 1 parts from rank 0 at step 0: its gradients differ where DDP makes them equal"
    assert any("no_sync() only on the micro-batches" in r for r in v["remedies"])
    assert [f["run"] for f in result["across_ranks"]] == ["B"]


@pytest.mark.slow
def test_every_rank_on_the_same_batches_is_named(ddp_runs, capsys):
    code, out, _ = diff(capsys, ddp_runs / "good", ddp_runs / "unsharded")
    assert code == 1
    assert "verdict: setup: in B, ranks 0 and 1 trained on the same batches at every step" in out
    assert "DistributedSampler" in out


@pytest.mark.slow
def test_epochs_in_one_order_name_set_epoch(ddp_runs, capsys):
    """Three epochs of 4 steps a rank without sampler.set_epoch: every epoch repeats the first one's order."""
    code, out, _ = diff(capsys, ddp_runs / "epochs", ddp_runs / "no_set_epoch")
    assert code == 1
    assert ("verdict: setup: in B, every epoch trains on the same batches in the same order (epochs of 4 steps): "
            "the sampler is not told the epoch") in out
    assert "call sampler.set_epoch(epoch) at the start of every epoch" in out
    assert "epoch order" not in diff(capsys, ddp_runs / "epochs", ddp_runs / "epochs")[1]
    # a sampler that does not shuffle repeats its order by choice: not named
    code, out, _ = diff(capsys, ddp_runs / "ordered", ddp_runs / "ordered")
    assert code == 0 and "same order" not in out


@pytest.mark.slow  # the one-rank gloo fixture
def test_a_rank_folder_whose_manifest_lies_about_its_rank_is_refused(one_rank, tmp_path, capsys):
    ddp_copy(one_rank, tmp_path)
    shutil.copytree(tmp_path / "ddp" / "rank0", tmp_path / "ddp" / "rank1")  # rank1/ says it is rank 0
    code, _, err = diff(capsys, tmp_path / "ddp", tmp_path / "ddp")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "rank1: its manifest says rank 0, not 1" in err
    manifest = tmp_path / "ddp" / "rank1" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["distributed"] = {"rank": "1", "world_size": 2}
    manifest.write_text(json.dumps(m))
    code, _, err = diff(capsys, tmp_path / "ddp", tmp_path / "ddp")
    assert code == 2 and "has no valid distributed rank" in err and len(err.strip().splitlines()) == 1
