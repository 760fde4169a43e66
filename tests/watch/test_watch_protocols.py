"""The watched model is an ordinary model inside the block (issue 45): whatever the watch attaches is no part of
the model's state. Before, ``torch.save(model)`` raised ``PicklingError`` and ``copy.deepcopy`` /
``AveragedModel`` raised ``cannot pickle '_hashlib.HASH'`` (the hooks were bound methods of the watch, kept in each
module's ``_forward_hooks``); a copy made inside the block was recorded as well. Each test runs the same loop
bare and watched and asks for the same numbers."""

from __future__ import annotations

import copy
import io
import json
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main

NET = textwrap.dedent('''
    import torch.nn as nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))
''')

exec(compile(NET, "<net>", "exec"))  # Net, here as a user's model file defines it
Net = globals()["Net"]


def _loop(model, out=None, steps=4, call=None, each=None, opt=None):
    """A user's loop; ``out``: watched into that folder (None: bare). ``each(model, step)`` runs inside the block
    after every step (a checkpoint, an EMA update, a copy); its results are returned with the losses."""
    torch.manual_seed(0)
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    call = call or (lambda m: m)
    losses, extra = [], []

    def body():
        for step in range(steps):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            loss = nn.functional.cross_entropy(call(model)(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if each is not None:
                extra.append(each(model, step))

    if out is None:
        body()
    else:
        with convcheck.watch(model, opt, out=out):
            body()
    return losses, extra


def _fresh():
    torch.manual_seed(0)
    return Net()


def _steps(out) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _no_hooks(model) -> bool:
    return all(not (m._forward_hooks or m._forward_pre_hooks or m._forward_hooks_with_kwargs
                    or m._forward_pre_hooks_with_kwargs or m._backward_hooks) for m in model.modules())


def test_torch_save_of_the_model_inside_the_block_loads_where_convcheck_is_not_installed(tmp_path):
    (tmp_path / "usernet.py").write_text(NET)
    sys.path.insert(0, str(tmp_path))
    try:
        import usernet

        def save(model, step):
            twin = usernet.Net()
            twin.load_state_dict(model.state_dict())
            torch.save(twin, tmp_path / f"twin{step}.pt")  # a whole-model checkpoint of a model made in the block
            torch.save(model, tmp_path / f"model{step}.pt")
            return model(torch.ones(1, 6)).tolist()

        model = usernet.Net()
        _, outs = _loop(model, tmp_path / "run", each=save)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("usernet", None)
    code = textwrap.dedent(f'''
        import sys
        sys.modules["convcheck"] = None  # any import of convcheck fails
        sys.path.insert(0, {str(tmp_path)!r})
        import torch
        m = torch.load({str(tmp_path / "model3.pt")!r}, weights_only=False)
        assert not m._forward_hooks and not m.fc1._forward_hooks, "hooks came with the model"
        print(m(torch.ones(1, 6)).tolist())
    ''')
    got = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert json.loads(got.stdout) == outs[-1]


def test_pickle_and_deepcopy_inside_the_block_copy_no_hook_and_the_copy_is_not_recorded(tmp_path):
    copies = []

    def each(model, step):
        for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert _no_hooks(twin)
            twin(torch.randn(2, 6))  # a copy's forward, with gradients on, in train mode: not the run's
            copies.append(twin)
        return [p.detach().clone() for p in copies[-1].parameters()]

    bare, _ = _loop(_fresh())
    watched, params = _loop(_fresh(), tmp_path / "run", each=each)
    assert watched == bare
    for s in _steps(tmp_path / "run"):
        assert len(s["batch_sha256"]) == 1  # the original's forward only
    assert _no_hooks(copies[0])


def test_averaged_model_updated_every_step_matches_the_bare_run(tmp_path):
    def run(out):
        model = _fresh()
        ema = []

        def each(m, step):
            if not ema:
                ema.append(torch.optim.swa_utils.AveragedModel(
                    m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)))
            ema[0].update_parameters(m)
            return ema[0](torch.ones(2, 6)).tolist()

        return _loop(model, out, each=each)

    assert run(tmp_path / "run") == run(None)
    assert len(_steps(tmp_path / "run")) == 4


def test_a_state_dict_round_trip_through_a_copy_made_in_the_block(tmp_path):
    def each(model, step):
        twin = copy.deepcopy(model)
        sd = model.state_dict()
        twin.load_state_dict(sd)
        model.load_state_dict(twin.state_dict())
        return sorted(sd) + sorted(twin.state_dict())

    bare = _loop(_fresh(), each=each)
    assert _loop(_fresh(), tmp_path / "run", each=each) == bare


def test_to_and_half_inside_the_block(tmp_path):
    def each(model, step):
        half = copy.deepcopy(model).half()
        model.to(torch.float64).to(torch.float32)
        return half(torch.ones(2, 6, dtype=torch.float16)).tolist()

    assert _loop(_fresh(), tmp_path / "run", each=each) == _loop(_fresh(), each=each)


def test_torch_compile_inside_the_block_trains_the_same_and_warns_nothing(tmp_path):
    compiled = {}

    def call(model):
        if model not in compiled:
            compiled[model] = torch.compile(model, backend="eager")
        return compiled[model]

    torch._dynamo.reset()
    bare, _ = _loop(_fresh(), call=call)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watched, _ = _loop(_fresh(), tmp_path / "run", call=call)
    assert watched == bare
    assert len(_steps(tmp_path / "run")) == 4
    assert not torch.nn.modules.module._has_any_global_hook()  # nothing left behind after the block


def test_data_parallel_made_inside_the_block_on_the_cpu(tmp_path):
    dp = {}

    def call(model):
        return dp.setdefault(model, nn.DataParallel(model))

    bare, _ = _loop(_fresh(), call=call)
    watched, _ = _loop(_fresh(), tmp_path / "run", call=call)
    assert watched == bare
    assert list(_steps(tmp_path / "run")[0]["layers"]) == ["fc1", "act", "fc2"]


def _dp_run(out, wrap: bool):
    model = _fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watched = nn.DataParallel(model) if wrap else model
    return _loop(watched, out, opt=opt)[0]


def test_a_data_parallel_run_names_the_users_layers_and_diffs_ok_against_the_model_unwrapped(tmp_path, capsys):
    assert _dp_run(tmp_path / "dp", True) == _dp_run(tmp_path / "plain", False)
    m = json.loads((tmp_path / "dp" / "manifest.json").read_text())
    assert m["model"]["wrapper"] == "DataParallel" and m["model"]["class"] == "Net"
    assert m["model"]["layers"] == ["fc1", "act", "fc2"]
    assert [p["name"] for p in m["model"]["parameters"]] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert set(_steps(tmp_path / "dp")[0]["grad_norms"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "plain"), str(tmp_path / "dp")]) == 0
    assert "verdict: ok" in capsys.readouterr().out


def test_a_compiled_child_is_named_as_the_users_layer(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    model[0] = torch.compile(model[0], backend="eager")  # its parameters: 0._orig_mod.weight
    torch._dynamo.reset()
    _loop(model, tmp_path / "run", steps=2)
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert [p["name"] for p in m["model"]["parameters"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert "0" in m["model"]["layers"] and not any("_orig_mod" in n for n in m["model"]["layers"])


@pytest.mark.parametrize("name, parallel, user", [
    ("module.fc1", True, "fc1"), ("module.fc1", False, "module.fc1"), ("enc._orig_mod.fc", False, "enc.fc"),
    ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.fc", False, "layers.0.fc"),
    ("block._checkpoint_wrapped_module.fc.weight", False, "block.fc.weight")])
def test_user_name(name, parallel, user):
    from convcheck.watch.attach import user_name

    assert user_name(name, parallel) == user


def test_a_users_child_called_module_keeps_its_name_and_a_data_parallel_child_loses_it(tmp_path):
    from convcheck.watch.attach import parallel_prefixes, user_name

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(6, 6)  # the user's own name
            self.body = nn.DataParallel(nn.Sequential(nn.Linear(6, 3)))

        def forward(self, x):
            return self.body(self.module(x))

    model = Outer()
    wrapped = parallel_prefixes(model)
    assert wrapped == {"body"}
    assert [user_name(n, wrappers=wrapped) for n, _ in model.named_parameters()] == [
        "module.weight", "module.bias", "body.0.weight", "body.0.bias"]
    _loop(model, tmp_path / "run", steps=1)
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["model"]["layers"] == ["module", "body.0"]


def test_jit_trace_and_export_inside_the_block_as_without_it(tmp_path):
    """The watch's hooks stay out of ``torch.jit.trace`` and ``torch.export`` (they read fake or traced tensors)."""

    def each(model, step):
        x = torch.ones(2, 6)
        traced = torch.jit.trace(model, x)
        exported = torch.export.export(model, (x,))
        return traced(x).tolist(), exported.module()(x).tolist()

    assert _loop(_fresh(), tmp_path / "run", each=each) == _loop(_fresh(), each=each)
    assert all(len(s["batch_sha256"]) == 1 for s in _steps(tmp_path / "run"))
