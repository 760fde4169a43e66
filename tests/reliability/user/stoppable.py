"""A model that stops to be signalled: at a chosen point it writes the marker file named by CC_MARK and waits.

CC_AT=factory waits in the model factory (before any measuring); CC_AT=<n> waits in the n-th forward call
(n=18 is inside training of a 3-step run at a given thread count: it makes 21 in all, after the --classes
check and the one-step parity check). Inputs 1x4x4, 3 classes.
"""

import os
import time
from pathlib import Path

import torch.nn as nn

CALLS = 0  # forward calls in this process, every copy of the model together


def _wait():
    Path(os.environ["CC_MARK"]).write_text("waiting")
    for _ in range(600):  # ends when the signal's handler raises; never reached in a passing test
        time.sleep(0.1)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        global CALLS
        CALLS += 1
        at = os.environ.get("CC_AT", "")
        if at.isdigit() and CALLS == int(at):
            _wait()
        return self.fc(x.flatten(1))


def make():
    if os.environ.get("CC_AT") == "factory":
        _wait()
    return _Net()


def make_then_ctrl_c_at_exit():
    """The model, and a Ctrl-C delivered as the process exits (after the report is written)."""
    import atexit
    import signal

    atexit.register(os.kill, os.getpid(), signal.SIGINT)
    return _Net()
