"""convcheck under torchrun (issue 12): detected from the launcher's environment and refused in one line.

convcheck starts its own rank processes; inside a torchrun world it would run the whole comparison on
every rank and share rank 0's process group with its single-device arms (``convcheck.ddp.launch``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from convcheck.cli import main
from convcheck.ddp.launch import check_not_under_torchrun, launched_world
from convcheck.errors import UsageError
from convcheck.targets import parse_targets

TORCHRUN_ENV = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="10.0.0.5", MASTER_PORT="29500")
REPO = Path(__file__).resolve().parent.parent


def test_the_launchers_world_is_read_from_the_environment():
    assert launched_world({}) is None
    assert launched_world({"MASTER_ADDR": "h", "MASTER_PORT": "1"}) is None  # no rank: not launched
    w = launched_world(TORCHRUN_ENV)
    assert (w.rank, w.world, w.local_rank, w.endpoint) == (1, 2, 1, "10.0.0.5:29500")
    assert w.variables == ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    partial = launched_world({"WORLD_SIZE": "4", "RANK": "x"})
    assert (partial.rank, partial.world, partial.endpoint) == (None, 4, "")


def test_a_ddp_target_under_torchrun_is_refused_saying_what_to_run():
    with pytest.raises(UsageError) as err:
        check_not_under_torchrun(parse_targets("cpu,ddp:cpu:2"), TORCHRUN_ENV)
    msg = str(err.value)
    assert "\n" not in msg and "started by torchrun (rank 1 of 2" in msg
    assert msg.endswith("run it once, without torchrun, on one machine: convcheck compare ... --targets cpu,ddp:cpu:2")


def test_a_world_of_one_with_single_device_targets_runs_as_usual():
    one = dict(TORCHRUN_ENV, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    check_not_under_torchrun(parse_targets("cpu,cpu:bf16"), one)  # nothing to refuse
    check_not_under_torchrun(parse_targets("cpu,ddp:cpu:2"), {})  # not launched
    with pytest.raises(UsageError, match="ddp:cuda:2 \\(or ddp:cpu:N\\)"):
        check_not_under_torchrun(parse_targets("cpu,cpu:bf16"), TORCHRUN_ENV)  # the same run on every rank


def test_the_cli_under_torchruns_environment_is_exit_2_in_one_line(monkeypatch, capsys, tmp_path):
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    code = main(["compare", "--model", "lenet", "--targets", "cpu,ddp:cpu:2", "--steps", "2",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "started by torchrun" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_real_torchrun_with_two_ranks_is_refused(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "convcheck", "compare", "--model", "lenet", "--targets", "cpu,ddp:cpu:2", "--steps", "2",
         "--out", str(tmp_path / "run")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0  # torchrun reports its ranks' exit code 2 as a failure
    refusals = [line for line in proc.stderr.splitlines() if "convcheck: error: convcheck was started by torchrun" in line]
    assert len(refusals) >= 1 and "Traceback" not in "\n".join(refusals)
    assert "--targets cpu,ddp:cpu:2" in refusals[0]
