"""``parity_ab.py`` VARIANTS: main's ``TargetPass`` against this tree's (issue 28: NaN/Inf counted once)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convcheck.measure.parity as P  # noqa: E402
import convcheck.measure.parity.target_pass as new  # noqa: E402
from main_module import main_module  # noqa: E402

old = main_module("convcheck/measure/parity/target_pass.py")


def use(cls):
    def setup():
        P.TargetPass = cls
    return setup


VARIANTS = {"main": use(old.TargetPass), "branch": use(new.TargetPass)}
