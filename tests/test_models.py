"""convcheck.plan.models: --model resolution, input-spec inference, and every user-facing message."""

from __future__ import annotations

import sys
import textwrap
import uuid

import pytest
import torch
from torch import nn

from convcheck.errors import UsageError
from convcheck.plan.models import ResolvedModel, check_input_shape, parse_input_shape, resolve_model

USER_MODELS = """
    import torch
    from torch import nn

    def small_lenet():
        # 1x28x28 only: the Linear fixes the spatial size.
        return nn.Sequential(nn.Conv2d(1, 4, 5), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 24 * 24, 7))

    def small_cifar():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(4), nn.Flatten(),
                             nn.Linear(4 * 8 * 8, 10))

    def any_size():
        # Global pooling: every image size works, so none can be inferred.
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))

    def mlp():
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))

    def conv_head():
        # No Linear: the classes come from the output of one forward pass.
        return nn.Sequential(nn.Conv2d(1, 6, 28), nn.Flatten())

    def declared():
        return nn.Sequential(nn.Conv2d(2, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    declared.input_shape = (2, 16, 16)
    declared.num_classes = 3

    class Declares(nn.Module):
        input_shape = [3, 20, 20]

        def __init__(self):
            super().__init__()
            self.num_classes = 4
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                      nn.Linear(8, 4))

        def forward(self, x):
            return self.body(x)

    def bad_declared():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    bad_declared.input_shape = (784,)

    def raises():
        raise ValueError("width must be even\\nsecond line")

    def not_a_module():
        return 42

    built = small_lenet()
    NOT_CALLABLE = 3
"""


def _write(folder, name, body=USER_MODELS):
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh importable module holding USER_MODELS; returns its name."""
    name = f"usermodels_{uuid.uuid4().hex[:8]}"
    _write(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.fixture
def user_file(tmp_path):
    return _write(tmp_path, "my_models")


def _usage_error(*args, **kwargs) -> str:
    with pytest.raises(UsageError) as info:
        resolve_model(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- zoo ---------------------------------------------------------------------------

def test_zoo_name_uses_the_zoo_spec():
    resolved = resolve_model("lenet")
    assert isinstance(resolved, ResolvedModel)
    assert (resolved.name, resolved.input_shape, resolved.num_classes, resolved.source) == (
        "lenet", (1, 28, 28), 10, "zoo")
    assert isinstance(resolved.factory(), nn.Module)


def test_zoo_overrides_reach_the_model():
    resolved = resolve_model("cifar_cnn", input_shape=(3, 64, 64), num_classes=100)
    assert (resolved.input_shape, resolved.num_classes) == ((3, 64, 64), 100)
    check_input_shape(resolved.factory(), resolved.input_shape, resolved.num_classes)


def test_unknown_zoo_name_lists_the_known_ones():
    assert _usage_error("lenett") == (
        "unknown model 'lenett'; did you mean 'lenet'? Known models: cifar_cnn, lenet, mlp_regression, resnet18, "
        "resnet34, resnet50, unet; for your own model pass package.module:factory or path/to/file.py:factory")
    assert "did you mean" not in _usage_error("transformer")  # nothing near: the list alone


@pytest.mark.parametrize("bad", [0, -3, "10", True])
def test_classes_must_be_a_positive_integer(bad):
    assert "number of classes must be a positive integer" in _usage_error("lenet", num_classes=bad)


# --- package.module:factory and file.py:factory -------------------------------------------

def test_module_factory(user_module):
    resolved = resolve_model(f"{user_module}:small_lenet")
    assert (resolved.input_shape, resolved.num_classes, resolved.source) == ((1, 28, 28), 7, "module")
    assert resolved.name == f"{user_module}.small_lenet"
    assert resolved.spec == f"{user_module}:small_lenet"
    assert resolved.factory() is not resolved.factory()


def test_module_factory_in_a_package():
    resolved = resolve_model("reference_models.resnet:resnet18")
    assert (resolved.input_shape, resolved.num_classes, resolved.name) == (
        (3, 224, 224), 1000, "resnet.resnet18")


def test_module_in_the_working_directory_imports_without_leaving_it_on_sys_path(tmp_path, monkeypatch):
    name = f"cwdmodels_{uuid.uuid4().hex[:8]}"
    _write(tmp_path, name)
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    try:
        assert resolve_model(f"{name}:small_cifar").input_shape == (3, 32, 32)
    finally:
        sys.modules.pop(name, None)
    assert sys.path == path_before


def test_file_factory(user_file):
    resolved = resolve_model(f"{user_file}:small_cifar")
    assert (resolved.input_shape, resolved.num_classes, resolved.source) == ((3, 32, 32), 10, "file")
    assert resolved.name == "my_models.small_cifar"


def test_file_may_import_its_neighbours_and_define_dataclasses(tmp_path):
    _write(tmp_path, "helpers_for_net", "from torch import nn\nWIDTH = 6\n")
    net = _write(tmp_path, "net", """
        from dataclasses import dataclass
        from torch import nn
        from helpers_for_net import WIDTH

        @dataclass
        class Config:
            width: int = WIDTH

        def build():
            return nn.Sequential(nn.Conv2d(1, Config().width, 28), nn.Flatten(), nn.Linear(6, 2))
    """)
    try:
        resolved = resolve_model(f"{net}:build")
    finally:
        sys.modules.pop("helpers_for_net", None)
    assert (resolved.input_shape, resolved.num_classes) == ((1, 28, 28), 2)


def test_resolving_leaves_the_global_rng_alone(user_file):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    resolve_model(f"{user_file}:small_lenet")
    assert torch.equal(torch.rand(3), expected)


# --- input spec: declared, overridden, inferred -------------------------------------------

def test_declared_on_the_factory(user_module):
    resolved = resolve_model(f"{user_module}:declared")
    assert (resolved.input_shape, resolved.num_classes) == ((2, 16, 16), 3)


def test_declared_on_the_model(user_module):
    resolved = resolve_model(f"{user_module}:Declares")
    assert (resolved.input_shape, resolved.num_classes) == ((3, 20, 20), 4)


def test_overrides_beat_declarations(user_module):
    resolved = resolve_model(f"{user_module}:declared", input_shape=(2, 8, 8), num_classes=3)
    assert (resolved.input_shape, resolved.num_classes) == ((2, 8, 8), 3)
    resolved = resolve_model(f"{user_module}:declared", input_shape=(2, 8, 8))
    assert (resolved.input_shape, resolved.num_classes) == ((2, 8, 8), 3)


def test_classes_override_the_model_does_not_output_is_refused(user_module):
    """--classes 9 on a model whose logits have 3 classes: said as it is, not as a rejected input shape."""
    with pytest.raises(UsageError) as info:
        resolve_model(f"{user_module}:declared", input_shape=(2, 8, 8), num_classes=9)
    assert str(info.value).endswith("outputs 3 classes but --classes says 9: pass --classes 3, "
                                    "or leave it out to use the model's own")


def test_inferred_channels_size_and_classes(user_module):
    resolved = resolve_model(f"{user_module}:small_lenet")
    assert (resolved.input_shape, resolved.num_classes) == ((1, 28, 28), 7)


def test_classes_inferred_from_the_output_without_a_linear(user_module):
    resolved = resolve_model(f"{user_module}:conv_head", input_shape=(1, 28, 28))
    assert resolved.num_classes == 6


def test_size_agnostic_model_needs_input_shape(user_module):
    assert _usage_error(f"{user_module}:any_size") == (
        f"cannot tell the input size of model '{user_module}:any_size' "
        "(it accepts both 3x28x28 and 3x32x32); pass --input-shape C,H,W")
    assert resolve_model(f"{user_module}:any_size", input_shape=(3, 32, 32)).num_classes == 5


def test_model_without_conv_needs_input_shape(user_module):
    message = _usage_error(f"{user_module}:mlp")
    assert message == (f"cannot tell the input shape of model '{user_module}:mlp' (no Conv2d layer); "
                       "pass --input-shape C,H,W")


def test_declared_shape_must_be_chw(user_module):
    assert _usage_error(f"{user_module}:bad_declared") == (
        f"input_shape declared by model '{user_module}:bad_declared' is (784,), "
        "not three positive integers C,H,W")


# --- every bad input, one line each --------------------------------------------------------

@pytest.mark.parametrize("spec", [":build", "mymod:", "my mod:build", "mymod:1build", "a:b:c"])
def test_bad_syntax(spec):
    assert _usage_error(spec) == (
        f"model {spec!r} is not a zoo name, package.module:factory or path/to/file.py:factory")


def test_module_not_found():
    assert _usage_error("no_such_module_xyz:build") == (
        "cannot import module 'no_such_module_xyz': ModuleNotFoundError: "
        "No module named 'no_such_module_xyz'; is it installed, or on PYTHONPATH?")


def test_module_that_fails_to_import_says_why(tmp_path, monkeypatch):
    name = f"broken_{uuid.uuid4().hex[:8]}"
    _write(tmp_path, name, "import torch\nraise ImportError('needs timm >= 0.9')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _usage_error(f"{name}:build") == (
        f"cannot import module '{name}': ImportError: needs timm >= 0.9")


def test_file_not_found(tmp_path):
    missing = tmp_path / "nope.py"
    assert _usage_error(f"{missing}:build") == f"model file '{missing}' not found"


def test_file_not_python(tmp_path):
    text = tmp_path / "model.txt"
    text.write_text("x = 1\n")
    assert _usage_error(f"{text}:build") == f"model file '{text}' is not a Python file (.py)"


def test_file_that_fails_to_load_says_why(tmp_path):
    path = _write(tmp_path, "typo", "def build(:\n    pass\n")
    message = _usage_error(f"{path}:build")
    assert message.startswith(f"cannot load model file '{path}': SyntaxError: ")


def test_factory_missing(user_module, user_file):
    assert _usage_error(f"{user_module}:nope") == f"module '{user_module}' has no factory 'nope'"
    assert _usage_error(f"{user_file}:nope") == f"file '{user_file}' has no factory 'nope'"


def test_factory_raising_is_wrapped(user_module):
    assert _usage_error(f"{user_module}:raises") == (
        f"model factory '{user_module}:raises' raised ValueError: width must be even")


def test_factory_returning_a_non_module(user_module):
    assert _usage_error(f"{user_module}:not_a_module") == (
        f"model factory '{user_module}:not_a_module' returned int, not a torch.nn.Module")


def test_model_instance_is_not_a_factory(user_module):
    assert _usage_error(f"{user_module}:built") == (
        f"'built' in module '{user_module}' is a model instance, not a factory; "
        "point at a function or class that builds it")


def test_non_callable_attribute(user_module):
    assert _usage_error(f"{user_module}:NOT_CALLABLE") == (
        f"'NOT_CALLABLE' in module '{user_module}' is a int, not a callable factory")


# --- parse_input_shape ---------------------------------------------------------------

@pytest.mark.parametrize("text, shape", [("3,32,32", (3, 32, 32)), (" 1, 28 ,28 ", (1, 28, 28)),
                                         ("3x224x224", (3, 224, 224))])
def test_parse_input_shape(text, shape):
    assert parse_input_shape(text) == shape


@pytest.mark.parametrize("text", ["", "3,32", "3,32,32,1", "a,b,c", "3,0,32", "3,-1,32", "3.0,32,32"])
def test_parse_input_shape_rejects(text):
    with pytest.raises(UsageError) as info:
        parse_input_shape(text)
    assert str(info.value) == (
        f"input shape {text!r} is not three positive integers C,H,W (e.g. 3,32,32)")


# --- check_input_shape ------------------------------------------------------------------

def test_check_input_shape_accepts_the_zoo_specs():
    for name in ["lenet", "cifar_cnn"]:
        resolved = resolve_model(name)
        check_input_shape(resolved.factory(), resolved.input_shape, resolved.num_classes)


def test_check_input_shape_rejects_a_wrong_size():
    with pytest.raises(UsageError) as info:
        check_input_shape(resolve_model("lenet").factory(), (1, 32, 32), 10, name="lenet")
    assert str(info.value) == ("model 'lenet' rejects input shape 1x32x32: "
                               "mat1 and mat2 shapes cannot be multiplied (2x576 and 400x120)")


def test_check_input_shape_rejects_wrong_classes():
    with pytest.raises(UsageError) as info:
        check_input_shape(resolve_model("lenet").factory(), (1, 28, 28), 12, name="lenet")
    # the input fits: the class count is what is wrong, and the message says so (new-user trial 5: through the
    # API it blamed the input shape)
    assert str(info.value) == ("model 'lenet' outputs 10 classes but 12 were asked for (--classes / num_classes): "
                               "pass 10, or leave it out to use the model's own")


def test_check_input_shape_leaves_the_model_as_it_was():
    model = resolve_model("cifar_cnn").factory().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check_input_shape(model, (3, 32, 32), 10)
    assert model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
