"""The fingerprint's dispatch section (issue 36): SDPA's backends (enabled, and the one a call reached here),
Triton, and the environment variables that steer numerics - in `convcheck env --json`, diffed by
`env --against`."""

from __future__ import annotations

import json

import pytest
import torch

from convcheck.cli.main import main
from convcheck.env import collect
from convcheck.env.diff import diff
from convcheck.env.fingerprint import Fingerprint


def test_env_json_holds_the_sdpa_backends_triton_and_the_numerics_variables(monkeypatch, capsys):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("SOMETHING_ELSE", "x")
    capsys.readouterr()
    main(["env", "--json"])
    d = json.loads(capsys.readouterr().out)["fingerprint"]["dispatch"]
    assert d["recorded"] is True
    assert {k: d[k] for k in ("sdpa_flash", "sdpa_mem_efficient", "sdpa_math", "sdpa_cudnn")} == {
        "sdpa_flash": torch.backends.cuda.flash_sdp_enabled(),
        "sdpa_mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "sdpa_math": torch.backends.cuda.math_sdp_enabled(), "sdpa_cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
    if not torch.cuda.is_available():
        assert d["sdpa_probe"] == "cpu float32 (2, 4, 128, 64)"
        assert d["sdpa_dispatched"] in ("flash (CPU)", "math")
    assert "triton" in d
    assert {"NCCL_ALGO=Tree", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1", "CUDA_LAUNCH_BLOCKING=1"} <= set(d["env"])
    assert not any(v.startswith("SOMETHING_ELSE") for v in d["env"])


def test_turning_a_backend_off_is_seen_and_dispatch_follows(monkeypatch):
    old = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        d = collect().dispatch
    finally:
        torch.backends.cuda.enable_flash_sdp(old)
    assert d.sdpa_flash is False
    if not torch.cuda.is_available():
        assert d.sdpa_dispatched == "math"  # the CPU's flash kernel off: the math path


def test_collecting_draws_no_random_number():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    collect()
    assert torch.equal(before, torch.get_rng_state())


def test_env_against_names_a_variable_set_on_one_side(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    other = collect().to_dict()
    other["dispatch"]["env"] = [v for v in other["dispatch"]["env"] if not v.startswith("NCCL_ALGO=")] + ["NCCL_ALGO=Tree"]
    other["dispatch"]["triton"] = "3.3.0 (triton)"
    (tmp_path / "gpu.json").write_text(json.dumps(other))
    diffs = {d.field: (d.left, d.right) for d in diff(collect(), Fingerprint.from_dict(other))}
    assert diffs["NCCL_ALGO"] == ("Ring", "Tree")
    assert diffs["Triton"][1] == "3.3.0 (triton)"
    capsys.readouterr()
    main(["env", "--against", str(tmp_path / "gpu.json")])
    out = capsys.readouterr().out
    assert "NCCL_ALGO" in out and "Tree" in out


def test_an_older_fingerprint_without_the_section_loads_and_diffs_nothing_of_it():
    old = collect().to_dict()
    del old["dispatch"]
    fp = Fingerprint.from_dict(old)
    assert fp.dispatch.recorded is False
    assert not [d for d in diff(collect(), fp) if d.field.startswith(("SDPA", "Triton", "NCCL", "TORCH", "CUDA"))]


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_MODULE_LOADING",
                                  "NCCL_VERSION", "PYTORCH_VERSION"])
def test_a_variable_that_changes_no_number_is_recorded_but_not_a_difference(monkeypatch, name):
    """torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING in every worker, containers export versions: recorded,
    never a "version" finding."""
    monkeypatch.setenv(name, "0")
    here = collect()
    other = here.to_dict()
    other["dispatch"]["env"] = [v.replace(f"{name}=0", f"{name}=3") for v in other["dispatch"]["env"]]
    assert f"{name}=0" in here.dispatch.env
    assert not [d for d in diff(here, Fingerprint.from_dict(other)) if d.field == name]
