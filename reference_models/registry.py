"""The model zoo: a name for each reference model, with its input spec.

``list_models()`` names them, ``get_spec(name)`` describes one, and
``get_model(name)`` builds it. This package stands alone: it never imports
convcheck.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from reference_models.cifar_cnn import cifar_cnn
from reference_models.lenet import lenet
from reference_models.mlp_regression import mlp_regression
from reference_models.resnet import resnet18, resnet34, resnet50
from reference_models.unet import unet

# What a model learns; it decides the synthetic data and the default loss.
TASKS = ("classification", "segmentation", "regression")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    factory: Callable[..., nn.Module]   # builds a fresh model; accepts num_classes=
    input_shape: tuple[int, ...]        # one sample: C, H, W (images) or F (tabular features)
    num_classes: int                    # classes (per pixel for segmentation); outputs for regression
    description: str
    task: str = "classification"        # classification | segmentation | regression


class UnknownModelError(KeyError, ValueError):
    """A name that is not in the zoo. Both a KeyError (a failed lookup) and a ValueError."""

    def __str__(self) -> str:
        # KeyError would quote the message; show it as written.
        return str(self.args[0]) if self.args else ""


_SPECS = {
    spec.name: spec
    for spec in [
        ModelSpec("lenet", lenet, (1, 28, 28), 10,
                  "LeNet-5 (MNIST): 2 conv, 3 fc, ReLU, max pooling"),
        ModelSpec("cifar_cnn", cifar_cnn, (3, 32, 32), 10,
                  "small VGG-style CNN (CIFAR-10): 6 conv with BatchNorm, widths 32/64/128"),
        ModelSpec("resnet18", resnet18, (3, 224, 224), 1000,
                  "ResNet-18 (ImageNet), torchvision-compatible parameter names"),
        ModelSpec("resnet34", resnet34, (3, 224, 224), 1000,
                  "ResNet-34 (ImageNet), torchvision-compatible parameter names"),
        ModelSpec("resnet50", resnet50, (3, 224, 224), 1000,
                  "ResNet-50 (ImageNet, bottleneck blocks), torchvision-compatible parameter names"),
        ModelSpec("unet", unet, (1, 64, 64), 3,
                  "small U-Net (1x64x64 segmentation, 3 classes per pixel), widths 8/16/32", "segmentation"),
        ModelSpec("mlp_regression", mlp_regression, (16,), 1,
                  "tabular regression MLP: 16 features -> 64 -> 64 -> 1, mean squared error", "regression"),
    ]
}


def list_models() -> list[str]:
    """The zoo's model names, sorted."""
    return sorted(_SPECS)


def get_spec(name: str) -> ModelSpec:
    """The spec of one zoo model; an unknown name raises ``UnknownModelError`` naming the known ones."""
    try:
        return _SPECS[name]
    except KeyError:
        known = ", ".join(list_models())
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None


def get_model(name: str, **kwargs) -> nn.Module:
    """Build a fresh zoo model; ``kwargs`` go to its factory (e.g. ``num_classes=100``)."""
    return get_spec(name).factory(**kwargs)
