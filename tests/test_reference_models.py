"""reference_models: every zoo model builds and runs; ResNets match torchvision's layout."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import reference_models
from reference_models import ModelSpec, UnknownModelError, get_model, get_spec, list_models
from reference_models.resnet import BasicBlock, Bottleneck, ResNet

ZOO = ["cifar_cnn", "lenet", "mlp_regression", "resnet18", "resnet34", "resnet50", "unet"]


def _seeded_input(shape, batch=2):
    gen = torch.Generator().manual_seed(0)
    return torch.randn((batch, *shape), generator=gen)


# --- registry ---------------------------------------------------------------------

def test_list_models_names_the_zoo_sorted():
    assert list_models() == ZOO


@pytest.mark.parametrize("name", ZOO)
def test_spec_describes_the_model(name):
    spec = get_spec(name)
    assert isinstance(spec, ModelSpec)
    assert spec.name == name
    assert len(spec.input_shape) == (1 if spec.task == "regression" else 3)
    assert all(isinstance(d, int) for d in spec.input_shape)
    assert spec.num_classes > 0
    assert spec.description


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_spec("lenet").num_classes = 3


@pytest.mark.parametrize("name", ["lenet", "cifar_cnn", "resnet18"])
def test_zoo_model_forward_gives_one_logit_per_class(name):
    spec = get_spec(name)
    model = get_model(name).eval()
    with torch.no_grad():
        out = model(_seeded_input(spec.input_shape))
    assert out.shape == (2, spec.num_classes)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["resnet34", "resnet50"])
def test_deep_resnet_forward_at_batch_one(name):
    model = get_model(name).eval()
    with torch.no_grad():
        out = model(_seeded_input((3, 224, 224), batch=1))
    assert out.shape == (1, 1000)


def test_get_model_passes_num_classes_to_the_factory():
    model = get_model("cifar_cnn", num_classes=100)
    assert model(_seeded_input((3, 32, 32))).shape == (2, 100)


def test_get_model_builds_a_fresh_model_each_time():
    assert get_model("lenet") is not get_model("lenet")


def test_unknown_name_lists_the_known_models():
    with pytest.raises(UnknownModelError) as info:
        get_spec("lenett")
    assert str(info.value) == (
        "unknown model 'lenett'; known models: cifar_cnn, lenet, mlp_regression, resnet18, resnet34, resnet50, unet"
    )
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(KeyError):
        get_model("nope")


def test_package_does_not_import_convcheck():
    for path in Path(reference_models.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "convcheck" for n in names), path.name


# --- LeNet-5 ------------------------------------------------------------------------

def test_lenet_layers_are_named_modules_in_order():
    model = get_model("lenet")
    leaves = [name for name, m in model.named_modules() if not list(m.children())]
    assert leaves == ["conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "flatten",
                      "fc1", "relu3", "fc2", "relu4", "fc3"]
    assert all(not m.inplace for m in model.modules() if isinstance(m, nn.ReLU))
    assert sum(p.numel() for p in model.parameters()) == 61_706
    assert (model.fc1.in_features, model.fc3.out_features) == (400, 10)


# --- CIFAR CNN -------------------------------------------------------------------------

def test_cifar_cnn_has_batchnorm_and_no_dropout():
    model = get_model("cifar_cnn")
    kinds = {type(m) for m in model.modules()}
    assert nn.BatchNorm2d in kinds
    assert not any(issubclass(k, nn.modules.dropout._DropoutNd) for k in kinds)
    widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert widths == [32, 32, 64, 64, 128, 128]


def test_cifar_cnn_trains_a_step():
    torch.manual_seed(0)
    model = get_model("cifar_cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _seeded_input((3, 32, 32), batch=32), torch.arange(32) % 10
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# --- ResNet ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, params, keys", [
    ("resnet18", 11_689_512, 122),
    ("resnet34", 21_797_672, 218),
    ("resnet50", 25_557_032, 320),
])
def test_resnet_sizes_match_torchvision(name, params, keys):
    model = get_model(name)
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(model.state_dict()) == keys


def test_resnet50_state_dict_names_match_torchvision():
    keys = set(get_model("resnet50").state_dict())
    for key in ["conv1.weight", "bn1.running_mean", "bn1.num_batches_tracked",
                "layer1.0.conv1.weight", "layer1.0.conv3.weight", "layer1.0.bn3.bias",
                "layer1.0.downsample.0.weight", "layer1.0.downsample.1.running_var",
                "layer2.3.conv2.weight", "layer3.5.bn2.weight",
                "layer4.2.bn3.running_var", "fc.weight", "fc.bias"]:
        assert key in keys, key
    assert "layer1.1.downsample.0.weight" not in keys


def test_resnet18_state_dict_names_match_torchvision():
    keys = set(get_model("resnet18").state_dict())
    for key in ["layer1.1.bn2.running_mean", "layer2.0.downsample.0.weight",
                "layer4.1.conv2.weight", "fc.bias"]:
        assert key in keys, key
    assert "layer1.0.downsample.0.weight" not in keys   # 64 -> 64, stride 1: no shortcut conv
    assert not any("conv3" in k for k in keys)


def test_resnet_state_dict_round_trips_strictly():
    source, target = get_model("resnet18"), get_model("resnet18")
    target.load_state_dict(source.state_dict(), strict=True)
    assert torch.equal(target.layer3[1].conv2.weight, source.layer3[1].conv2.weight)


def test_resnet_depth_is_data():
    model = ResNet(Bottleneck, [3, 4, 6, 3])
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    assert isinstance(get_model("resnet34").layer3[5], BasicBlock)


def test_resnet_init_matches_torchvision():
    torch.manual_seed(0)
    model = get_model("resnet18")
    # kaiming_normal_, fan_out, relu: std = sqrt(2 / (out_channels * kh * kw))
    expected = (2 / (64 * 7 * 7)) ** 0.5
    assert model.conv1.weight.std().item() == pytest.approx(expected, rel=0.05)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(torch.all(bn.weight == 1) and torch.all(bn.bias == 0) for bn in bns)


@pytest.mark.parametrize("block, calls", [(BasicBlock, 2), (Bottleneck, 3)])
def test_block_shares_one_inplace_relu(block, calls):
    model = ResNet(block, [1, 1, 1, 1], num_classes=10).eval()
    relu = model.layer1[0].relu
    assert relu.inplace
    seen = []
    relu.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        model(_seeded_input((3, 64, 64), batch=1))
    assert len(seen) == calls
