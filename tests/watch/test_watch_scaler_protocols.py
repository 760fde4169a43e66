"""The GradScaler is an ordinary scaler inside the block (issue 45). Before, the watch set its wrappers of
``unscale_``/``step``/``scale`` on the scaler object itself: ``pickle.dumps(scaler)`` and ``torch.save(scaler)``
raised ``Can't pickle local object``, and ``copy.deepcopy(scaler)`` copied the wrappers - the copy's ``step``
called the original's, during and after the block. Now the scaler's classes are wrapped while the block runs and
each call is routed by identity (``watch/scaler_use.py``). Each test runs the loop bare and watched and asks for
the same numbers."""

from __future__ import annotations

import copy
import io
import json
import pickle
import subprocess
import sys
import textwrap

import torch
import torch.nn as nn

import convcheck
from convcheck.watch import scaler_use

METHODS = ("unscale_", "step", "scale")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _loop(out=None, each=None, steps=4, scaler_cls=torch.amp.GradScaler, unscale_first=True):
    """A float16-autocast loop with a GradScaler and clipping; ``each(scaler, model, step)`` runs after every
    step inside the block (a checkpoint, a copy). Returns the losses, the scales and what ``each`` returned."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls("cpu", init_scale=2.0 ** 12)
    g = torch.Generator().manual_seed(1)
    losses, scales, extra = [], [], []

    def body():
        for step in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
            if each is not None:
                extra.append(each(scaler, model, step))

    if out is None:
        body()
    else:
        with convcheck.watch(model, opt, out=out, scaler=scaler):
            body()
    return losses, scales, extra


def _steps(out) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _nothing_set(scaler) -> bool:
    return not set(vars(scaler)) & set(METHODS)


def test_pickle_deepcopy_and_torch_save_of_the_scaler_inside_the_block(tmp_path):
    def each(scaler, model, step):
        buf = io.BytesIO()
        torch.save({"scaler": scaler, "state": scaler.state_dict()}, buf)  # a whole-object checkpoint
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)["scaler"]
        twins = [pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler), copy.copy(scaler), loaded]
        assert all(_nothing_set(t) for t in twins)
        return [t.get_scale() for t in twins] + [t.state_dict() for t in twins]

    bare = _loop(each=each)
    watched = _loop(tmp_path / "run", each=each)
    assert watched == bare
    assert [s["scale"] for s in _steps(tmp_path / "run")] == bare[1]


def test_a_scaler_saved_inside_the_block_loads_where_convcheck_is_not_installed(tmp_path):
    def each(scaler, model, step):
        torch.save(scaler, tmp_path / f"scaler{step}.pt")
        return scaler.state_dict()

    _, _, states = _loop(tmp_path / "run", each=each)
    code = textwrap.dedent(f'''
        import sys
        sys.modules["convcheck"] = None  # any import of convcheck fails
        import torch
        s = torch.load({str(tmp_path / "scaler3.pt")!r}, weights_only=False)
        assert not {{"step", "scale", "unscale_"}} & set(vars(s)), "the watch came with the scaler"
        print(s.get_scale())
    ''')
    got = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert float(got.stdout) == states[-1]["scale"]


def test_a_copy_made_inside_the_block_steps_on_its_own_during_and_after_it(tmp_path):
    """The copy's ``step`` is its own: it skips on its own found Inf (the original's scale does not move), and
    nothing of the watch stays on it after the block."""
    copies = []

    def each(scaler, model, step):
        if not copies:
            copies.append(copy.deepcopy(scaler))
        return None

    _loop(tmp_path / "run", each=each)
    twin = copies[0]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = twin.get_scale()
    twin.scale(model(torch.full((2, 16), float("inf"))).sum()).backward()  # Inf gradients: the step is skipped
    twin.step(opt)
    twin.update()
    assert twin.get_scale() == before * twin.get_backoff_factor()
    assert _nothing_set(twin)


def test_the_scalers_classes_are_as_they_were_after_the_block(tmp_path):
    own = {n: vars(torch.amp.GradScaler)[n] for n in METHODS}
    clip = torch.nn.utils.clip_grad_norm_
    _loop(tmp_path / "run")
    assert {n: vars(torch.amp.GradScaler)[n] for n in METHODS} == own
    assert torch.nn.utils.clip_grad_norm_ is clip
    assert not getattr(scaler_use, "_PATCHED", {}) and not getattr(scaler_use, "_SPIES", {})


class _Sub(torch.amp.GradScaler):
    """A user's scaler whose methods call the base class's (each wrapped: the spies see the call once)."""

    def step(self, optimizer, *args, **kwargs):
        return super().step(optimizer, *args, **kwargs)

    def unscale_(self, optimizer):
        return super().unscale_(optimizer)


def test_a_subclass_calling_super_is_seen_once_and_clipping_scaled_gradients_is_still_found(tmp_path):
    assert _loop(tmp_path / "right", scaler_cls=_Sub)[:2] == _loop(scaler_cls=_Sub)[:2]
    assert not any(s.get("clip_before_unscale") for s in _steps(tmp_path / "right"))
    _loop(tmp_path / "wrong", scaler_cls=_Sub, unscale_first=False)
    assert all(s.get("clip_before_unscale") for s in _steps(tmp_path / "wrong"))
    assert "stepped 2 optimizers" not in (tmp_path / "wrong" / "manifest.json").read_text()


def test_another_scaler_in_the_process_is_not_the_watched_ones(tmp_path):
    """A second GradScaler (not given to the watch) stepping another optimizer is not counted as the watched
    scaler's."""
    other_model = _model()
    other_opt = torch.optim.SGD(other_model.parameters(), lr=0.1)
    other = torch.amp.GradScaler("cpu")

    def each(scaler, model, step):
        other.scale(other_model(torch.ones(2, 16)).sum()).backward()
        other.step(other_opt)
        other.update()

    _loop(tmp_path / "run", each=each)
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert not any("stepped 2 optimizers" in n for n in m.get("notes", []))
