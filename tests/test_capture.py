"""convcheck.capture: leaf-module call hooks and in-place activation handling."""

from __future__ import annotations

import torch
import torch.nn as nn

from convcheck.capture import LeafCalls, disable_inplace, leaf_modules
from reference_models import get_model


def _calls(model, x):
    seen = []
    with LeafCalls(model, lambda key, name, module, inputs, out: seen.append((key, name, module, out))) as lc:
        model(x)
    return lc, seen


def test_repeated_calls_of_one_module_get_numbered_keys():
    model = get_model("resnet18", num_classes=10).eval()
    lc, seen = _calls(model, torch.randn(1, 3, 32, 32))
    keys = [k for k, *_ in seen]
    assert keys == lc.order
    assert len(keys) == len(set(keys))
    # torchvision's BasicBlock calls its one relu twice
    assert "layer1.0.relu" in keys and "layer1.0.relu#2" in keys
    assert "layer1.0.relu#3" not in keys
    assert keys.index("layer1.0.relu") < keys.index("layer1.0.bn2") < keys.index("layer1.0.relu#2")
    # the stem's relu is called once
    assert "relu" in keys and "relu#2" not in keys
    # every call carries the module's own name and the module itself
    by_key = {k: (n, m) for k, n, m, _ in seen}
    name, module = by_key["layer2.1.relu#2"]
    assert name == "layer2.1.relu"
    assert module is model.get_submodule("layer2.1.relu")
    # each leaf appears, and the count of relu calls is 1 + 2 per block
    relu_calls = [k for k in keys if k.split("#")[0].endswith("relu")]
    assert len(relu_calls) == 1 + 2 * 8


def test_bottleneck_relu_is_called_three_times():
    model = get_model("resnet50", num_classes=10).eval()
    lc, _ = _calls(model, torch.randn(1, 3, 32, 32))
    assert {"layer1.0.relu", "layer1.0.relu#2", "layer1.0.relu#3"} <= set(lc.order)
    assert "layer1.0.relu#4" not in lc.order


def test_keys_restart_for_a_new_leafcalls_and_hooks_are_removed():
    model = get_model("lenet")
    x = torch.randn(2, 1, 28, 28)
    lc1, _ = _calls(model, x)
    lc2, _ = _calls(model, x)
    assert lc1.order == lc2.order
    assert all("#" not in k for k in lc1.order)
    assert all(not m._forward_hooks for m in model.modules())


def test_outputs_passed_to_the_callback_are_the_real_outputs():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    x = torch.randn(5, 4)
    _, seen = _calls(model, x)
    assert [k for k, *_ in seen] == ["0", "1"]
    assert torch.equal(seen[1][3], model(x))


def test_leaf_modules_of_a_leaf_root_is_the_root():
    lin = nn.Linear(2, 2)
    assert leaf_modules(lin) == [("Linear", lin)]
    _, seen = _calls(lin, torch.randn(1, 2))
    assert [k for k, *_ in seen] == ["Linear"]


def test_disable_inplace_turns_off_inplace_activations():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3),
                          nn.Hardtanh(inplace=True), nn.Dropout(0.0, inplace=True), nn.ReLU()).eval()
    assert sum(getattr(m, "inplace", False) for m in model.modules()) == 3
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        before = model(x)
    assert disable_inplace(model) is model
    assert not any(getattr(m, "inplace", False) for m in model.modules())
    with torch.no_grad():
        after = model(x)
    assert torch.equal(before, after)


def test_with_inplace_off_hooks_see_clean_inputs():
    """An in-place relu would overwrite the tensor a hook saw as the previous layer's output."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True))
    disable_inplace(model)
    x = torch.randn(16, 8)
    _, seen = _calls(model, x)
    linear_out = seen[0][3]
    assert (linear_out < 0).any()  # not clobbered by the relu
