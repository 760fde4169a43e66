"""Options shared by ``convcheck compare`` and the pytest plugin, declared once; parsed options -> config.

``declare_compare_options(addoption, prefix)`` takes ``argparse``'s
``add_argument`` or pytest's ``parser.addoption``; the plugin passes the
prefix ``convcheck-`` so its flags read ``--convcheck-targets`` and so on.
``config_from_options(values, prefix)`` turns the parsed values into a
``CompareConfig``. Defaults are read from ``CompareConfig``; none are written here.
"""

from __future__ import annotations

import argparse

from convcheck.plan.config import OPTIMIZERS, CompareConfig, default, with_options

# option name -> config field it sets (tolerance options map onto CompareConfig.tolerances)
OPTION_NAMES = ("targets", "judge", "steps", "batch-size", "seed", "envelope", "data", "workers", "bound-factor",
                "min-error",
                "loss", "optimizer", "lr", "momentum", "nesterov", "weight-decay", "betas", "eps", "schedule",
                "warmup", "clip-grad-norm", "ddp-sync-bn", "ddp-no-broadcast-buffers", "verify", "threads", "repeat")


# An option set in [tool.convcheck] can be switched back off on the command line: each takes an explicit
# off value (OFF_WORDS for a value, --no-FLAG for a switch). The values that mean "off / the default":
OFF_WORDS = ("off", "none", "default")


def _or_default(convert):
    """``convert``, or None (the config's default) for one of ``OFF_WORDS``."""
    def parse(text):
        if isinstance(text, str) and text.strip().lower() in OFF_WORDS:
            return None
        return convert(text)
    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _clip(text):
    """``--clip-grad-norm X``: a positive number, or 0 / off for no clipping."""
    value = _or_default(float)(text)
    return None if value == 0 else value


_clip.__name__ = "float"


def declare_compare_options(addoption, prefix: str = "") -> None:
    def opt(name: str, **kw):
        field = name.replace("-", "_")
        addoption(f"--{prefix}{name}", dest=f"{prefix}{name}".replace("-", "_"), default=default(field), **kw)

    opt("targets", metavar="A,B", type=_or_default(str),
        help="two target specs, e.g. cpu,cuda or cuda:tf32,cuda:no-tf32 "
             "(default: cpu,cuda with a GPU, else cpu,cpu:float64)")
    opt("judge", metavar="SPEC", type=_or_default(str),
        help="the float64 reference: cpu:float64 or cuda[:N]:float64 "
             "(default: cuda:float64 on a GPU with fast float64, else cpu:float64)")
    opt("steps", type=int, help="lockstep training steps (default %(default)s)")
    opt("batch-size", type=int, help="batch size (default %(default)s)")
    opt("loss", metavar="FILE.py:fn", type=_or_default(str),
        help="your loss, fn(output, target) -> scalar tensor (FILE.py:fn or package.module:fn; "
             "default: cross-entropy on class logits; 'default' returns to it)")
    opt("optimizer", metavar="NAME",
        help=f"any torch.optim class by name, case-insensitive ({', '.join(OPTIMIZERS)}, ...), or "
             "FILE.py:factory taking the parameters (default %(default)s)")
    opt("lr", type=float, help="learning rate (default %(default)s)")
    opt("momentum", type=_or_default(float),
        help="momentum (default: 0.9 for sgd, the optimizer's own otherwise; 'default' returns to it)")
    opt("nesterov", action=argparse.BooleanOptionalAction, help="Nesterov momentum (sgd); --no-nesterov: off")
    opt("weight-decay", type=float, help="weight decay (default %(default)s)")
    opt("betas", type=_or_default(_betas), metavar="B1,B2",
        help="Adam-style betas, e.g. 0.9,0.999 ('default': the optimizer's own)")
    opt("eps", type=_or_default(float), help="the optimizer's eps ('default': the optimizer's own)")
    opt("schedule", metavar="SCHEDULE",
        help="learning-rate schedule: constant, cosine, step:EVERY:GAMMA, onecycle, or FILE.py:factory "
             "taking (optimizer, steps) (default %(default)s)")
    opt("warmup", type=int, metavar="N", help="linear warm-up steps before the schedule (default %(default)s)")
    opt("clip-grad-norm", type=_clip, metavar="X",
        help="clip the gradient norm to X before every step (0 or off: no clipping, the default)")
    opt("ddp-sync-bn", action=argparse.BooleanOptionalAction,
        help="ddp: targets: convert every BatchNorm to SyncBatchNorm in the data-parallel copies "
             "(--no-ddp-sync-bn: off)")
    opt("ddp-no-broadcast-buffers", action=argparse.BooleanOptionalAction,
        help="ddp: targets: DistributedDataParallel(broadcast_buffers=False), as your own training may set it "
             "(--no-ddp-no-broadcast-buffers: off)")
    opt("verify", action=_boolean_optional(),
        help="after a verdict other than ok, re-run the failing arm with each remedy applied and say which "
             "verifies (--no-verify: nothing extra; default: the first remedy, one training run of one arm)")
    opt("seed", type=int, help="seed for weights and batches (default %(default)s)")
    opt("envelope", type=int,
        help="perturbed runs of the lower-precision target for the noise envelope; 0 turns it off "
             "(default %(default)s)")
    opt("data", metavar="SOURCE", type=_or_default(str),
        help="synthetic (default), mnist:DIR (IDX files, raw or .gz), npz:PATH (arrays x, y), digits "
             "(scikit-learn's 8x8 digits, upsampled), or FILE.py:factory returning a Dataset or an "
             "iterable of batches")
    opt("workers", type=int, metavar="N", help="DataLoader workers for a Dataset (default %(default)s)")
    opt("repeat", type=int, metavar="1|2",
        help="2: run every target twice from the same state at the first step, deterministic kernels too; a "
             "bitwise difference is named with its layer and op, none means the targets' differences are not "
             "chance (default %(default)s)")
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
