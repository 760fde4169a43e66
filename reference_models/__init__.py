"""Reference models for convcheck: LeNet-5, a small CIFAR CNN, ResNet-18/34/50.

Each model is one readable file; ``registry`` gives them names. This package
does not import convcheck, so it can be used (and copied) on its own.
"""

from reference_models.registry import ModelSpec, UnknownModelError, get_model, get_spec, list_models

__all__ = ["ModelSpec", "UnknownModelError", "get_model", "get_spec", "list_models"]
