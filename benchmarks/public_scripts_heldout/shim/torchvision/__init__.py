"""A minimal local stand-in for torchvision (it does not import beside this CPU torch): only what the
pytorch/examples scripts run here use. Data are synthetic and deterministic (seeded per index, the global
RNG untouched); sizes are capped by PS_MNIST_N / PS_FAKE_N / PS_FAKE_SIZE so the runs stay tiny."""
from . import datasets, models, transforms, utils  # noqa: F401
__version__ = "0.0-shim"
