"""convcheck: why does the same PyTorch model converge on one device and not on another?

The public API, imported lazily so that ``import convcheck`` stays fast::

    import convcheck
    result = convcheck.compare("lenet", "cpu,cpu:emulate-tf32")
    print(result.verdict.category, result.verdict.headline)

    with convcheck.watch(model, optimizer, out="runs/gpu") as w:   # the user's own loop, recorded
        ...
"""

from convcheck.errors import ConvcheckError, RunFailed, TargetUnavailable, UsageError

__version__ = "0.1.0"

_LAZY = {
    "compare": ("convcheck.pipeline", "compare"),
    "CompareResult": ("convcheck.pipeline", "CompareResult"),
    "CompareConfig": ("convcheck.pipeline", "CompareConfig"),
    "Target": ("convcheck.targets.spec", "Target"),
    "Tolerances": ("convcheck.numerics.metrics", "Tolerances"),
    "Verdict": ("convcheck.diagnose", "Verdict"),
    "assert_parity": ("convcheck.assertions", "assert_parity"),
    "watch": ("convcheck.watch", None),  # the package, callable: convcheck.watch(model, optimizer, out=...)
    "seed_everything": ("convcheck.watch", "seed_everything"),
}

__all__ = ["ConvcheckError", "RunFailed", "TargetUnavailable", "UsageError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = importlib.import_module(module)
        value = value if attr is None else getattr(value, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'convcheck' has no attribute {name!r}")
