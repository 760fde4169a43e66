import os

import pytest
import torch

pytest_plugins = ["pytester"]

# The test models are tiny: intra-op threads buy nothing, and on a busy machine spinning
# OpenMP threads make the suite several times slower. CONVCHECK_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("CONVCHECK_TEST_THREADS", "1")))


def live_children() -> list[int]:
    """Live child processes of this process (zombies excluded; multiprocessing's resource tracker, which
    the first spawn starts and which ends with this process, too)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and not _resource_tracker(pid):
            out.append(int(pid))
    return out


@pytest.fixture
def no_orphans():
    """Fails the test when a child process it started (a DDP rank) is still alive after it; yields the
    function listing this process's live children."""
    import multiprocessing
    import time

    before = set(live_children())
    yield live_children
    deadline = time.monotonic() + 5
    while set(live_children()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(live_children()) - before, "a rank process was left behind"
    multiprocessing.active_children()  # reap


def _resource_tracker(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False
