"""convcheck under torchrun (issue 12): the launcher's world serves the data-parallel target.

Rank 0 runs the comparison (its DDP rank in a relay process), the other ranks serve and exit 0
(``convcheck.ddp.torchrun``); what cannot work is refused in one line, exit 2 (``check_launch``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from convcheck.cli.main import main
from convcheck.ddp.launch import check_launch, launched_world
from convcheck.errors import UsageError
from convcheck.targets.spec import parse_targets

TORCHRUN_ENV = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="10.0.0.5", MASTER_PORT="29500")
REPO = Path(__file__).resolve().parents[2]


def test_the_launchers_world_is_read_from_the_environment():
    assert launched_world({}) is None
    assert launched_world({"MASTER_ADDR": "h", "MASTER_PORT": "1"}) is None  # no rank: not launched
    w = launched_world(TORCHRUN_ENV)
    assert (w.rank, w.world, w.local_rank, w.endpoint) == (1, 2, 1, "10.0.0.5:29500")
    assert w.variables == ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    partial = launched_world({"WORLD_SIZE": "4", "RANK": "x"})
    assert (partial.rank, partial.world, partial.endpoint) == (None, 4, "")


def test_a_ddp_target_of_the_worlds_size_is_served_by_it():
    assert check_launch(parse_targets("cpu,ddp:cpu:2"), TORCHRUN_ENV).world == 2
    assert check_launch(parse_targets("cpu,ddp:cpu:2"), {}) is None  # not launched: convcheck starts the ranks
    one = dict(TORCHRUN_ENV, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    assert check_launch(parse_targets("cpu,cpu:bf16"), one) is None  # a world of one: as if run alone


@pytest.mark.parametrize("targets,env,says", [
    ("cpu,ddp:cpu:4", TORCHRUN_ENV, "target ddp:cpu:4 asks for 4 ranks, the world has 2 (torchrun's --nnodes x "
                                    "--nproc-per-node); use ddp:cpu:2"),
    ("cpu,ddp:cpu:4:bf16", TORCHRUN_ENV, "use ddp:cpu:2:bf16"),
    ("cpu,cpu:bf16", TORCHRUN_ENV, "but no target is data-parallel: the world's ranks serve a ddp: target "
                                   "(--targets cpu,ddp:cpu:2 or cuda,ddp:cuda:2)"),
    ("cpu,ddp:cpu:2", {"RANK": "0", "WORLD_SIZE": "2"}, "with MASTER_ADDR, MASTER_PORT unset"),
    ("cpu,ddp:cpu:2", dict(TORCHRUN_ENV, RANK="5"), "not a rank of the world"),
])
def test_what_a_launched_world_cannot_run_is_one_line(targets, env, says):
    with pytest.raises(UsageError) as err:
        check_launch(parse_targets(targets), env)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("convcheck was started by torchrun (rank") and says in msg


def test_a_serving_rank_with_a_target_of_another_size_is_exit_2(monkeypatch, capsys, tmp_path):
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    code = main(["compare", "--model", "lenet", "--targets", "cpu,ddp:cpu:4", "--steps", "2",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "use ddp:cpu:2" in err
    assert not (tmp_path / "run").exists()


def _torchrun(tmp_path, *args, timeout_env="60"):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CONVCHECK_DDP_TIMEOUT=timeout_env)
    for k in TORCHRUN_ENV:
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           "-m", "convcheck", "compare", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_torchrun_with_two_ranks_runs_the_comparison_on_rank_0(tmp_path):
    out = tmp_path / "run"
    proc = _torchrun(tmp_path, "--model", "lenet", "--targets", "cpu,ddp:cpu:2", "--steps", "3", "--envelope", "1",
                     "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"]["category"] == "ok" and summary["targets"] == ["cpu", "ddp:cpu:2"]
    assert proc.stdout.count("Verdict: ok") == 1  # rank 0 reports; rank 1 served
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_under_torchrun_a_failing_rank_is_named_by_rank_0(tmp_path):
    (tmp_path / "lossfile.py").write_text(textwrap.dedent("""
        import torch.distributed as dist
        import torch.nn.functional as F

        def loss(out, y):
            if dist.is_initialized() and dist.get_rank() == 1:
                raise ValueError("boom on rank 1")
            return F.cross_entropy(out, y)
    """))
    proc = _torchrun(tmp_path, "--model", "lenet", "--targets", "cpu,ddp:cpu:2", "--steps", "2",
                     "--loss", f"{tmp_path / 'lossfile.py'}:loss", "--no-save")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("convcheck: error:")]
    assert lines and all("rank 1 of 2 during the parity step: loss 'lossfile.loss' raised ValueError: boom on rank 1"
                         in line for line in lines)
    assert "Traceback (most recent call last):\n  File" not in "\n".join(lines)


@pytest.mark.parametrize("targets,preset,expected", [  # ~2.5 s each: the last two in CI's slow pass
    ("cpu,ddp:cpu:2", None, "PASSIVE"), pytest.param("cpu,ddp:cpu:2", "ACTIVE", "ACTIVE", marks=pytest.mark.slow),
    pytest.param("cpu,cpu:bf16", None, None, marks=pytest.mark.slow)])
def test_a_ddp_run_from_the_cli_lets_openmp_threads_sleep_while_they_wait(targets, preset, expected):
    """OMP_WAIT_POLICY is set before torch loads (a fresh process), for data-parallel targets only."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OMP_WAIT_POLICY", None)
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    code = ("import os; from convcheck.cli.main import main; "
            f"rc = main(['compare', '--model', 'lenet', '--targets', '{targets}', '--steps', '0', '--no-save']); "
            "print(rc, os.environ.get('OMP_WAIT_POLICY'))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", str(expected)], proc.stderr  # --steps 0: a usage error, before any work
