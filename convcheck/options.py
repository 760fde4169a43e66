"""Options shared by ``convcheck compare`` and the pytest plugin, declared once.

``declare_compare_options(addoption, prefix)`` takes ``argparse``'s
``add_argument`` or pytest's ``parser.addoption``; the plugin passes the
prefix ``convcheck-`` so its flags read ``--convcheck-targets`` and so on.
"""

from __future__ import annotations

from convcheck.tolerances import DEFAULT_TOLERANCES, Tolerances

DEFAULTS = dict(steps=30, batch_size=32, optimizer="adam", lr=1e-3, seed=0, envelope=3)


def declare_compare_options(addoption, prefix: str = "") -> None:
    def opt(name: str, **kw):
        addoption(f"--{prefix}{name}", dest=f"{prefix}{name}".replace("-", "_"), **kw)

    opt("targets", default=None, metavar="A,B",
        help="two target specs, e.g. cpu,cuda or cuda:tf32,cuda:no-tf32 "
             "(default: cpu,cuda with a GPU, else cpu,cpu:float64)")
    opt("steps", type=int, default=DEFAULTS["steps"], help="lockstep training steps (default %(default)s)")
    opt("batch-size", type=int, default=DEFAULTS["batch_size"], help="batch size (default %(default)s)")
    opt("optimizer", default=DEFAULTS["optimizer"], choices=["sgd", "adam"], help="optimizer (default %(default)s)")
    opt("lr", type=float, default=DEFAULTS["lr"], help="learning rate (default %(default)s)")
    opt("seed", type=int, default=DEFAULTS["seed"], help="seed for weights and batches (default %(default)s)")
    opt("envelope", type=int, default=DEFAULTS["envelope"],
        help="perturbed runs of the lower-precision target for the noise envelope; 0 turns it off "
             "(default %(default)s)")
    opt("data", default=None, metavar="SOURCE",
        help="synthetic (default), mnist:DIR (IDX files, raw or .gz) or npz:PATH (arrays x, y)")
    opt("bound-factor", type=float, default=DEFAULT_TOLERANCES.bound_factor,
        help="flag a layer whose local error exceeds this many times its expected bound (default %(default)s)")
    opt("min-error", type=float, default=DEFAULT_TOLERANCES.min_error,
        help="...and exceeds this relative error (default %(default)s)")


def tolerances_from(values: dict, prefix: str = "") -> Tolerances:
    key = prefix.replace("-", "_")
    return Tolerances(bound_factor=values[f"{key}bound_factor"], min_error=values[f"{key}min_error"])
