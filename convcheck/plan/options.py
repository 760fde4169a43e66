"""Options shared by ``convcheck compare`` and the pytest plugin, declared once; parsed options -> config.

``declare_compare_options(addoption, prefix)`` takes ``argparse``'s
``add_argument`` or pytest's ``parser.addoption``; the plugin passes the
prefix ``convcheck-`` so its flags read ``--convcheck-targets`` and so on.
``config_from_options(values, prefix)`` turns the parsed values into a
``CompareConfig``. Defaults are read from ``CompareConfig``; none are written here.
"""

from __future__ import annotations

from convcheck.plan.config import OPTIMIZERS, CompareConfig, default, with_options

# option name -> config field it sets (tolerance options map onto CompareConfig.tolerances)
OPTION_NAMES = ("targets", "judge", "steps", "batch-size", "seed", "envelope", "data", "workers", "bound-factor",
                "min-error",
                "loss", "optimizer", "lr", "momentum", "nesterov", "weight-decay", "betas", "eps", "schedule",
                "warmup", "clip-grad-norm", "ddp-sync-bn", "ddp-no-broadcast-buffers", "verify", "threads")


def declare_compare_options(addoption, prefix: str = "") -> None:
    def opt(name: str, **kw):
        field = name.replace("-", "_")
        addoption(f"--{prefix}{name}", dest=f"{prefix}{name}".replace("-", "_"), default=default(field), **kw)

    opt("targets", metavar="A,B",
        help="two target specs, e.g. cpu,cuda or cuda:tf32,cuda:no-tf32 "
             "(default: cpu,cuda with a GPU, else cpu,cpu:float64)")
    opt("judge", metavar="SPEC",
        help="the float64 reference: cpu:float64 or cuda[:N]:float64 "
             "(default: cuda:float64 on a GPU with fast float64, else cpu:float64)")
    opt("steps", type=int, help="lockstep training steps (default %(default)s)")
    opt("batch-size", type=int, help="batch size (default %(default)s)")
    opt("loss", metavar="FILE.py:fn",
        help="your loss, fn(output, target) -> scalar tensor (FILE.py:fn or package.module:fn; "
             "default: cross-entropy on class logits)")
    opt("optimizer", metavar="NAME",
        help=f"any torch.optim class by name, case-insensitive ({', '.join(OPTIMIZERS)}, ...), or "
             "FILE.py:factory taking the parameters (default %(default)s)")
    opt("lr", type=float, help="learning rate (default %(default)s)")
    opt("momentum", type=float, help="momentum (default: 0.9 for sgd, the optimizer's own otherwise)")
    opt("nesterov", action="store_true", help="Nesterov momentum (sgd)")
    opt("weight-decay", type=float, help="weight decay (default %(default)s)")
    opt("betas", type=_betas, metavar="B1,B2", help="Adam-style betas, e.g. 0.9,0.999")
    opt("eps", type=float, help="the optimizer's eps")
    opt("schedule", metavar="SCHEDULE",
        help="learning-rate schedule: constant, cosine, step:EVERY:GAMMA, onecycle, or FILE.py:factory "
             "taking (optimizer, steps) (default %(default)s)")
    opt("warmup", type=int, metavar="N", help="linear warm-up steps before the schedule (default %(default)s)")
    opt("clip-grad-norm", type=float, metavar="X", help="clip the gradient norm to X before every step")
    opt("ddp-sync-bn", action="store_true",
        help="ddp: targets: convert every BatchNorm to SyncBatchNorm in the data-parallel copies")
    opt("ddp-no-broadcast-buffers", action="store_true",
        help="ddp: targets: DistributedDataParallel(broadcast_buffers=False), as your own training may set it")
    opt("verify", action=_boolean_optional(),
        help="after a verdict other than ok, re-run the failing arm with each remedy applied and say which "
             "verifies (--no-verify: nothing extra; default: the first remedy, one training run of one arm)")
    opt("seed", type=int, help="seed for weights and batches (default %(default)s)")
    opt("envelope", type=int,
        help="perturbed runs of the lower-precision target for the noise envelope; 0 turns it off "
             "(default %(default)s)")
    opt("data", metavar="SOURCE",
        help="synthetic (default), mnist:DIR (IDX files, raw or .gz), npz:PATH (arrays x, y), digits "
             "(scikit-learn's 8x8 digits, upsampled), or FILE.py:factory returning a Dataset or an "
             "iterable of batches")
    opt("workers", type=int, metavar="N", help="DataLoader workers for a Dataset (default %(default)s)")
    opt("threads", type=int, metavar="N",
        help="torch's CPU threads for every arm and the judge (default: OMP_NUM_THREADS / MKL_NUM_THREADS or "
             "torch.set_num_threads where set, else the faster of 1 and torch's default, timed on the first batch)")
    opt("bound-factor", type=float,
        help="flag a layer whose own error exceeds this many times its floor (the same layer in float64 on "
             "operands rounded to the target's precision) plus 4e-7 (default %(default)s)")
    opt("min-error", type=float,
        help="a flagged layer whose error stays below this is a note, not the verdict (default %(default)s)")


def _boolean_optional():
    import argparse

    return argparse.BooleanOptionalAction


def _betas(text: str) -> tuple[float, float]:
    import argparse

    try:
        b1, b2 = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers B1,B2, got {text!r}") from None
    return b1, b2


def config_from_options(values: dict, prefix: str = "", base: CompareConfig | None = None) -> CompareConfig:
    """The ``CompareConfig`` that parsed options (``vars(args)`` or pytest's option namespace) describe."""
    key = prefix.replace("-", "_")
    given = {name: values[f"{key}{name.replace('-', '_')}"] for name in OPTION_NAMES
             if f"{key}{name.replace('-', '_')}" in values}
    return with_options(base or CompareConfig(), **given)
