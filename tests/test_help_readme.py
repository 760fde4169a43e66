"""Help = README (issue 44): every option and target mode each subcommand's ``--help`` knows is in the
command-line reference (docs/cli.md, linked from README.md), every option the reference's synopsis gives a
subcommand is one it takes, the numbers it shows as defaults are the parser's, every target spec it names
parses, and the documented default output folders are where files land."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from convcheck.cli.main import build_parser, main
from convcheck.targets.runners import known_modes
from convcheck.targets.spec import DDP_FORMS, DEVICES, SPEC_FORM, Target

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_PAGE = ROOT / "docs" / "cli.md"  # the command-line reference, moved out of the README (issue 44)
WATCH_PAGE = ROOT / "docs" / "watch.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SUBCOMMANDS = ("compare", "record", "diff", "env", "models", "targets")


REFERENCE = CLI_PAGE.read_text(encoding="utf-8")


def test_the_readme_links_the_reference():
    assert "(docs/cli.md)" in README.read_text(encoding="utf-8")


def _synopsis() -> dict[str, set[str]]:
    """``{subcommand: the --flags its lines of the synopsis block give}`` (continuation lines included)."""
    block = REFERENCE[REFERENCE.index("```text") + len("```text"):]
    block = block[:block.index("```")]
    flags: dict[str, set[str]] = {}
    current = None
    for line in block.splitlines():
        m = re.match(r"(?:python -m )?convcheck (\w+)", line)
        if m:
            current = m.group(1)
        elif line.strip() and not line.startswith(" "):
            current = None
        if current:
            flags.setdefault(current, set()).update(FLAG.findall(line.split("#")[0]))
    return flags


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_option_of_the_help_is_in_the_reference(name):
    missing = sorted(o for o in _options(_subparsers()[name]) if not re.search(rf"(?<![\w-]){o}(?![\w-])", REFERENCE))
    assert not missing, f"convcheck {name} --help has options docs/cli.md does not name: {missing}"


def test_every_subcommand_has_a_synopsis_line():
    assert set(_synopsis()) >= set(SUBCOMMANDS), sorted(set(SUBCOMMANDS) - set(_synopsis()))


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_option_of_the_synopsis_is_the_subcommands(name):
    unknown = sorted(_synopsis().get(name, set()) - _options(_subparsers()[name]))
    assert not unknown, f"docs/cli.md's synopsis of convcheck {name} gives options it does not take: {unknown}"


def test_the_synopsis_defaults_are_the_parsers():
    """``[--steps 30]`` in the synopsis is compare's default, and so on for every number shown."""
    p = _subparsers()["compare"]
    defaults = {o: a.default for a in p._actions for o in a.option_strings}
    block = REFERENCE[REFERENCE.index("```text"):]
    shown = re.findall(r"\[(--[a-z-]+) ([0-9][0-9.e-]*)[\]|]", block[:block.index("```", 7)])
    assert shown, "no default shown in the synopsis"
    wrong = [(flag, value, defaults.get(flag)) for flag, value in shown
             if defaults.get(flag) is not None and float(value) != float(defaults[flag])]
    assert not wrong, f"(option, docs/cli.md's default, the parser's): {wrong}"


def test_every_mode_and_device_of_the_help_is_in_the_reference():
    missing = [m for m in known_modes() if not re.search(rf"\b(cpu|cuda|mps)(:\d+)?:{re.escape(m)}(?![\w-])", REFERENCE)]
    assert not missing, f"target modes the help lists and docs/cli.md does not: {missing}"
    assert not [d for d in DEVICES if f"`{d}" not in REFERENCE and f"{d}:" not in REFERENCE], DEVICES
    for form in (SPEC_FORM, *DDP_FORMS):
        assert form in REFERENCE, f"{form} (compare --help's target form) is not in docs/cli.md"


def test_every_target_spec_of_the_reference_parses():
    specs = set(re.findall(r"`((?:ddp:)?(?:cpu|cuda|mps)(?::[a-z0-9-]+)*)`", REFERENCE))
    assert len(specs) > 10
    for spec in sorted(specs):
        Target.parse(spec)  # a UsageError names the spec docs/cli.md gets wrong


def test_the_help_names_every_mode_and_form():
    text = _subparsers()["compare"].epilog_factory()
    for mode in known_modes():
        assert f"  {mode} " in text
    for form in (SPEC_FORM, *DDP_FORMS):
        assert form in text


def test_diff_of_watched_runs_writes_nothing_without_out(tmp_path, monkeypatch, capsys):
    """The help and the docs (docs/watch.md): two bundles' diff writes a reports/ folder by default, two watched runs' none."""
    import torch

    import convcheck

    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 4), torch.randint(2, (8,))
        with convcheck.watch(model, opt, out=f"runs/{name}") as w:
            for _ in range(2):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                w.step(loss)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["diff", "runs/a", "runs/b"]) == 0
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    help_text = _subparsers()["diff"].format_help()
    assert "no files without --out" in " ".join(help_text.split())
    assert "no files without `--out`" in " ".join(WATCH_PAGE.read_text(encoding="utf-8").split())
