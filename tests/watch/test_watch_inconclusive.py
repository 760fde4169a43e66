"""Issue 43: a judge that replays every layer the watch recorded, or says it could not - ``inconclusive`` (exit 5),
never an ``ok`` that checked nothing - and a run folder's recorded code loaded only when this user signed it.

The scenarios are loops as a user writes them: a script whose model class lives in the script itself (``__main__``),
built with constructor arguments, whose layers take integer position ids, a bool flag as a keyword, and an
``LSTMCell``'s ``(h, c)`` tuple."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.registry import RULES
from convcheck.diagnose.rules.watched_coverage import pair_ok
from convcheck.diagnose.rules.watched_run import run_ok
from convcheck.diagnose.watched_evidence import PairEvidence, Parting, RunEvidence, Setup
from convcheck.report.verdict_lines import unwrapped
from convcheck.analysis.replay import Replay

SCRIPT = textwrap.dedent('''
    """A user's script: the model is defined here (``__main__``), built with arguments; its rotary layer takes
    integer positions and a keyword flag, its LSTMCell a (h, c) tuple. In bfloat16 the positions are cast to the
    model's dtype: 1536 and up round to multiples of 8 (the bug the judge must find)."""
    import sys

    import torch
    import torch.nn as nn

    import convcheck


    class Rotary(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.dim = dim

        def forward(self, x, pos, interleave=False):
            inv = 1.0 / (10000.0 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
            ang = pos.to(x.dtype).float()[:, None] * inv[None, :]  # the positions in the model's dtype
            cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
            a, b = (x[..., ::2], x[..., 1::2]) if interleave else x.chunk(2, -1)
            return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


    class Net(nn.Module):
        def __init__(self, vocab, width):
            super().__init__()
            self.emb = nn.Embedding(vocab, width)
            self.rot = Rotary(width)
            self.cell = nn.LSTMCell(width, width)
            self.head = nn.Linear(width, vocab)

        def forward(self, ids, pos, state):
            x = self.rot(self.emb(ids), pos, interleave=True)
            h, c = self.cell(x, state)
            return self.head(h)


    def main(out, dtype):
        torch.manual_seed(0)
        model = Net(50, 16).to(getattr(torch, dtype))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        with convcheck.watch(model, opt, out=out) as w:
            for _ in range(2):
                ids = torch.randint(0, 50, (64,), generator=g)
                pos = torch.arange(1536, 1600)
                state = (torch.zeros(64, 16, dtype=model.head.weight.dtype),) * 2
                loss = nn.functional.cross_entropy(model(ids, pos, state).float(), ids)
                opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)


    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
''')


def diff(capsys, *args) -> tuple[int, str, str]:
    code = main(["diff", *map(str, args), "--no-save"])
    out, err = capsys.readouterr()
    return code, unwrapped(out), err  # the prose wrapped at the terminal's width, read whole


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """The script run as a user runs it (``python train.py``), in float32 and bfloat16, signed with a key of
    its own (``CONVCHECK_CONFIG_DIR``)."""
    tmp = tmp_path_factory.mktemp("script")
    (tmp / "train.py").write_text(SCRIPT)
    env = dict(os.environ, CONVCHECK_CONFIG_DIR=str(tmp / "config"), PYTHONPATH=str(Path(__file__).parents[2]))
    for dtype in ("float32", "bfloat16"):
        subprocess.run([sys.executable, "train.py", str(tmp / dtype), dtype], cwd=tmp, env=env, check=True, timeout=300)
    return tmp


@pytest.fixture
def own_key(script_runs, monkeypatch):
    monkeypatch.setenv("CONVCHECK_CONFIG_DIR", str(script_runs / "config"))


def test_the_key_is_the_users_alone(script_runs):
    key = script_runs / "config" / "key"
    assert key.is_file() and (key.stat().st_mode & 0o777) == 0o600


def test_a_script_model_with_int_tuple_and_keyword_arguments_is_replayed_whole(script_runs, own_key, capsys,
                                                                              monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not where the script is: its class is not importable here
    code, out, _ = diff(capsys, script_runs / "float32", "--judge", "cpu:float64")
    assert code == 0, out
    assert "verdict: ok: every replayed layer is within its floor and the run stays finite" in out
    assert "the judge checked 4 of 4 layers (snapshot step 0)" in out


def test_a_bf16_rotary_layer_taking_integer_positions_is_found(script_runs, own_key, capsys, monkeypatch, tmp_path):
    """Issue 43's case: before, the attention's integer position ids kept it from the replay and the verdict was
    ok; now the call is replayed as it was made, and the positions rounded to bfloat16 are the layer's fault."""
    monkeypatch.chdir(tmp_path)
    code, out, _ = diff(capsys, script_runs / "bfloat16", "--judge", "cpu:float64")
    assert code == 1, out
    assert "verdict: layer: rot computes beyond its floor at step 0" in out


def test_a_run_signed_by_another_user_loads_no_code_and_is_inconclusive(script_runs, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CONVCHECK_CONFIG_DIR", str(tmp_path / "someone_else"))
    monkeypatch.chdir(tmp_path)
    code, out, _ = diff(capsys, script_runs / "float32", "--judge", "cpu:float64")
    assert code == 5, out
    assert "verdict: inconclusive: " in out and "it checked 3 of 4 layers: not rot" in out
    assert "not signed by this user here" in out
    assert "remedy: if you trust where this run folder came from, pass --trust-run" in out
    code, out, _ = diff(capsys, script_runs / "float32", "--judge", "cpu:float64", "--trust-run")
    assert code == 0 and "the judge checked 4 of 4 layers" in out
    code, out, _ = diff(capsys, script_runs / "bfloat16", "--judge", "cpu:float64", "--trust-run")
    assert code == 1 and "verdict: layer: rot computes beyond its floor at step 0" in out


class _Marker:
    """What a crafted pickle does on load: create a file (any code could run in its place)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _tiny(out) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(2):
            loss = model(torch.randn(3, 4)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


@pytest.mark.parametrize("as_zip", [False, True])
def test_a_crafted_pickle_in_a_run_folder_runs_nothing(tmp_path, capsys, monkeypatch, as_zip):
    monkeypatch.setenv("CONVCHECK_CONFIG_DIR", str(tmp_path / "config"))
    _tiny(tmp_path / "run")
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Marker(str(marker)))
    (tmp_path / "run" / "snapshots" / "model.pkl").write_bytes(evil)
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    m["code"].update(pickle_sha256=hashlib.sha256(evil).hexdigest(), hmac="0" * 64)  # no key signs it
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(m))
    run = tmp_path / "run"
    if as_zip:
        with zipfile.ZipFile(tmp_path / "run.zip", "w") as z:
            for p in sorted(run.rglob("*")):
                if p.is_file():
                    z.write(p, p.relative_to(run).as_posix())
        run = tmp_path / "run.zip"
    code, out, err = diff(capsys, run, "--judge", "cpu:float64")
    assert not marker.exists()
    assert code == 0, out + err  # torch's own layers rebuilt from safe data: every layer still checked
    assert "the judge checked 3 of 3 layers" in out
    assert "not signed by this user here" in out
    pickle.loads(evil)  # the file was a live one: loading it would have made the marker
    assert marker.exists()


# --- every verdict path with an empty replay (issue 43's acceptance) -------------------------------------------

def _empty_replay() -> Replay:
    return Replay("cpu:float64", note="the model's class x.Net is not importable here", layers=["fc1", "fc2"])


def _producer(step=3):
    return {"step": step, "layer": "fc1", "kind": "forward", "direction": "forward", "op": "exp", "magnitude": 1e5,
            "dtype": "float16"}


def _setup(sub="clip before unscale"):
    return Setup("the run clips before scaler.unscale_", sub, ["evidence"], ["remedy"], step=2)


RUN_PATHS = {
    "W109": dict(setup=(_setup(),)),
    "W110": dict(setup=(_setup(sub=__import__("convcheck.diagnose.detectors.watched_scaler",
                                              fromlist=["SUB_CAUSE"]).SUB_CAUSE),)),
    "W102": dict(divergence=Setup("the loss explodes", "divergence", ["e"], ["lower the lr"], step=4)),
    "W103": dict(producer=_producer(), scaled_backward=S.Symptom("fixed loss scale", "the run", "e", step=3,
                                                                  value=1.0)),
    "W104": dict(own=(S.Symptom(S.SMALL_UPDATES_LOST, "the run", "most updates round away", step=1,
                                extra={"format": "bfloat16"}),)),
    "W105": dict(producer=_producer()),
    "W108": dict(eval_from=2),
    "W107": dict(own=(S.Symptom(S.DEAD_RELUS, "the run", "90% dead", layer="fc1", step=20),), converged=False,
                 steps=40),
    "W106": dict(stopped={"exception": "RuntimeError", "message": "boom", "step": 3}),
    "ok": dict(),
    "ok, interrupted": dict(stopped={"exception": "KeyboardInterrupt", "message": "", "step": 3}),
}


@pytest.mark.parametrize("path", list(RUN_PATHS))
def test_no_single_run_path_ends_ok_with_an_empty_replay(path):
    from convcheck.diagnose.registry import decide

    fields = {"steps": 10, **RUN_PATHS[path]}
    v = decide(RunEvidence(replay=_empty_replay(), **fields), run_ok)
    assert v.category == EXPECTED[path], (path, v)
    rule = next((r for r in RULES if r.id == path), None)
    if rule is not None:  # the path walked is the one named: its rule fires on this evidence
        assert rule(RunEvidence(replay=_empty_replay(), **fields)) is not None
    # and no replay at all is the same
    assert decide(RunEvidence(replay=None, **fields), run_ok).category == EXPECTED[path]
    if path.startswith("ok"):
        assert "the judge replayed no layer" in v.headline


EXPECTED = {"W109": "setup", "W110": "setup", "W102": "setup", "W103": "numerics", "W104": "numerics",
            "W105": "numerics", "W108": "setup", "W107": "setup", "W106": "setup", "ok": "inconclusive",
            "ok, interrupted": "inconclusive"}


def test_every_single_run_rule_is_walked():
    """A new rule of watched_run.py (or any rule reading RunEvidence) must join RUN_PATHS."""
    ids = {r.id for r in RULES if r.reads is RunEvidence}
    assert ids - {"W101"} <= set(RUN_PATHS), ids - set(RUN_PATHS)  # W101 needs a replayed row: never empty


def test_the_pairs_ok_needs_the_judge_only_where_the_runs_part():
    from convcheck.diagnose.detectors.watched_causal import Outcome  # noqa: F401 - the outcome's type

    empty = (_empty_replay(), _empty_replay())
    agree = pair_ok(PairEvidence(steps=(5, 5), replays=empty))
    assert agree.category == "ok"  # the runs say they agree; the judge is not needed for that
    parted = PairEvidence(steps=(5, 5), replays=empty, parting=Parting(2, "fc1", "beyond rounding"),
                          precision="A float32, B bfloat16",
                          outcome=type("O", (), {"alike": True, "text": lambda self: "they end alike"})())
    v = pair_ok(parted)
    assert v.category == "inconclusive" and "did not check fc1" in v.headline
    wander = PairEvidence(steps=(5, 5), replays=empty, loss_wander=(3, 0.5, 0.51), loss_tol=1e-3)
    v = pair_ok(wander)
    assert v.category == "inconclusive" and "every layer" in v.headline
    replayed = Replay("cpu:float64", layers=["fc1", "fc2"], steps=[0])
    from convcheck.analysis.replay import LayerRow

    replayed.rows = [LayerRow(0, "fc1", 0, "bfloat16", 1e-3, 1e-3, 4e-3, False),
                     LayerRow(0, "fc2", 0, "bfloat16", 1e-3, 1e-3, 4e-3, False)]
    assert pair_ok(PairEvidence(steps=(5, 5), replays=(replayed, replayed), parting=Parting(2, "fc1", "x"),
                                precision=parted.precision, outcome=parted.outcome)).category == "ok"


def test_inconclusive_has_its_own_exit_code_and_is_in_the_help():
    from convcheck.exit_codes import EXIT_CODES, verdict_exit

    assert verdict_exit("inconclusive") == 5 and verdict_exit("ok") == 0 and verdict_exit("layer") == 1
    assert any(code == 5 and text.startswith("inconclusive") for code, text in EXIT_CODES)
    root = Path(__file__).parents[2]
    assert "exit 5" in (root / "README.md").read_text()
    assert "* 5 `inconclusive`" in (root / "docs" / "cli.md").read_text()  # the exit-code table


# --- remedies name only the formats the runs used (issue 43, item 5) --------------------------------------------

def _remedies(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.lstrip().startswith("remedy:")]


def test_a_bf16_runs_remedies_name_no_float16(script_runs, capsys, monkeypatch, tmp_path):
    """The bfloat16 run alone (its code not loaded: another user's key): small updates lost in its bf16 weights.
    The remedy used to say 'casting the model to bf16/fp16' - a format the run never used."""
    monkeypatch.setenv("CONVCHECK_CONFIG_DIR", str(tmp_path / "someone_else"))
    code, out, _ = diff(capsys, script_runs / "bfloat16", "--judge", "cpu:float64")
    assert code == 1 and "verdict: numerics: small updates lost" in out
    rem = " ".join(_remedies(out))
    assert "casting the model to bf16)" in rem
    assert "fp16" not in rem and "float16" not in rem.replace("bfloat16", "")


def test_a_float32_bf16_pairs_remedies_name_no_float16(script_runs, own_key, capsys):
    code, out, _ = diff(capsys, script_runs / "float32", script_runs / "bfloat16")
    assert code == 1, out
    rem = " ".join(_remedies(out))
    assert rem and "fp16" not in rem and "float16" not in rem.replace("bfloat16", "")


def test_the_format_rule_is_one_function():
    from convcheck.diagnose.remedies import (GRAD_SCALER_UNDERFLOW, KEEP_FLOAT32, LOSS_SCALE_REMEDIES, MASTER_WEIGHTS,
                                             only_used_formats)

    assert only_used_formats([MASTER_WEIGHTS], {"bfloat16"}) == [MASTER_WEIGHTS.replace("bf16/fp16", "bf16")]
    assert only_used_formats([MASTER_WEIGHTS], {"float16"}) == [MASTER_WEIGHTS.replace("bf16/fp16", "fp16")]
    # a switch offered from the format the run used stays; offered to a run that did not use it, it goes
    assert only_used_formats([GRAD_SCALER_UNDERFLOW], {"float16"}) == [GRAD_SCALER_UNDERFLOW]
    assert "instead of" not in only_used_formats([GRAD_SCALER_UNDERFLOW], {"bfloat16"})[0]
    # nothing left that the runs used: the general fix
    assert only_used_formats([LOSS_SCALE_REMEDIES[1]], {"bfloat16"}) == [KEEP_FLOAT32]


def test_layers_left_out_by_the_selection_make_a_single_run_inconclusive(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CONVCHECK_CONFIG_DIR", str(tmp_path / "config"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=tmp_path / "run", layers=["0"]) as w:
        for _ in range(2):
            loss = model(torch.randn(3, 4)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    code, out, _ = diff(capsys, tmp_path / "run", "--judge", "cpu:float64")
    assert code == 5, out
    assert "it checked 1 of 3 layers" in out
    assert "not checked: 1 (not recorded: the watch's layers=['0'] left it out)" in out
