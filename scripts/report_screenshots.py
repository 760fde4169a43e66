"""Screenshots of report.html for the README (docs/screenshots/): a healthy lenet, an inf culprit, a summed
loss, a DDP run and a diff of two bundles, each a real run, rendered by headless Chromium.

    python scripts/report_screenshots.py [--browser chromium] [--keep DIR]

Needs a Chromium (``apt-get install chromium``); writes docs/screenshots/<case>.png.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "screenshots"
SMALL = ["--steps", "6", "--batch-size", "16"]
CASES = {
    "healthy-lenet": ["compare", "--model", "lenet", "--targets", "cpu,cpu:bf16", "--envelope", "2", *SMALL],
    "inf-culprit": ["compare", "--model", "tests/scenarios/models.py:overflow_net", "--input-shape", "1,28,28",
                    "--targets", "cpu,cpu:fp16", "--envelope", "0", *SMALL],
    "summed-loss": ["compare", "--model", "lenet", "--loss", "scripts/screenshot_losses.py:summed",
                    "--optimizer", "sgd", "--lr", "0.5", "--envelope", "1", *SMALL],
    "ddp": ["compare", "--model", "lenet", "--targets", "cpu,ddp:cpu:2", "--envelope", "0", *SMALL],
}


def convcheck(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONVCHECK_NO_PROGRESS": "1"}
    done = subprocess.run([sys.executable, "-m", "convcheck", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"convcheck {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")


def screenshot(browser: str, page: Path, png: Path) -> None:
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1200,2400", f"--screenshot={png}", page.as_uri()], check=True,
                   capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--browser", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--keep", default=None, help="write the run folders here instead of a temporary one")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="convcheck-shots-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name, case in CASES.items():
            convcheck([*case, "--out", str(work / name), "--force"], ROOT)
        for target, bundle in (("cpu", "A"), ("cpu:bf16", "B")):
            convcheck(["record", "--model", "lenet", "--target", target, "--out", str(work / bundle), "--force",
                       *SMALL, "--envelope", "0"], ROOT)
        convcheck(["diff", str(work / "A"), str(work / "B"), "--out", str(work / "diff"), "--force"], ROOT)
        for name in (*CASES, "diff"):
            screenshot(args.browser, work / name / "report.html", OUT / f"{name}.png")
            print(f"{OUT / name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
