"""``parity_ab.py`` VARIANTS: main's ``round_to`` checks (isfinite + where, the float subnormal test)
against this tree's (issue 28). The bare floor steps round through the same functions: the last
variant set is the one they run."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convcheck.targets.runners.precision as new  # noqa: E402
from main_module import main_module  # noqa: E402

old = main_module("convcheck/targets/runners/precision.py")
NEW = (new._has_subnormal, new._round_bits)


def use(fns):
    def setup():
        new._has_subnormal, new._round_bits = fns
    return setup


VARIANTS = {"main": use((old._has_subnormal, old._round_bits)), "branch": use(NEW)}
