"""Which calls of a snapshot step are kept within its budget (issue 48).

A module called many times in one step (a recurrent cell unrolled over a sequence, a closure evaluated several times)
can hold far more than a snapshot's budget. Of each layer's calls the snapshot keeps the **first**, the **last**, the
**worst** (the largest max|x| of its outputs) and the **first non-finite** one, and as many others as fit: every call
arrives as its layer's last; a call that loses its last roles to a later one joins the *others*, and the newest
other is let go first, so what stays besides the roles is the step's earliest calls. A call that does not fit even
once every other is let go is not kept. ``summary`` says, per layer, how many calls it made, which were kept and
why, for the snapshot's index entry (``kept``) and the report."""

from __future__ import annotations

import math

ROLE_WORDS = {"first": "first", "last": "last", "worst": "worst", "nonfinite": "first non-finite"}


class CallKeeper:
    """The roles of one step's kept calls, layer by layer; the taker (``snapshots.py``) holds their arrays."""

    def __init__(self):
        self.roles: dict[tuple[str, int], set[str]] = {}  # a kept call -> its roles (none: kept as it fit)
        self.others: dict[tuple[str, int], None] = {}  # kept calls without a role, in the order they lost it
        self.calls: dict[str, int] = {}  # each layer's calls so far
        self.holder: dict[tuple[str, str], int] = {}  # (layer, role) -> the call that holds it
        self.worst: dict[str, tuple[int, float]] = {}  # layer -> (call, its max|x|): the worst seen, kept or not
        self.nonfinite: dict[str, int] = {}  # layer -> its first call with a NaN/Inf output, kept or not
        self.dropped = 0

    def arrive(self, layer: str, k: int, largest: float) -> set[str]:
        """The roles call ``k`` of ``layer`` (its outputs' max|x| ``largest``) takes as it arrives."""
        self.calls[layer] = k + 1
        roles = {"last"} | ({"first"} if k == 0 else set())
        if not math.isfinite(largest):
            if layer not in self.nonfinite:
                self.nonfinite[layer] = k
                roles.add("nonfinite")
        elif largest > self.worst.get(layer, (k, -math.inf))[1]:
            self.worst[layer] = (k, largest)
            roles.add("worst")
        return roles

    def keep(self, layer: str, k: int, roles: set[str]) -> None:
        """Call ``k`` kept with ``roles``: an earlier call that loses its last role joins the others."""
        for role in roles:
            old = self.holder.get((layer, role))
            self.holder[(layer, role)] = k
            if old is None or old == k or (layer, old) not in self.roles:
                continue
            left = self.roles[(layer, old)]
            left.discard(role)
            if not left:
                self.others[(layer, old)] = None
        self.roles[(layer, k)] = set(roles)

    def victim(self) -> tuple[str, int] | None:
        """The kept call to let go first (the newest other), or None when only calls with a role are left."""
        return next(reversed(self.others), None)

    def let_go(self, call: tuple[str, int]) -> None:
        self.others.pop(call, None)
        self.roles.pop(call, None)
        self.dropped += 1

    def not_kept(self) -> None:
        """The arriving call did not fit: its roles stay with the calls that held them."""
        self.dropped += 1

    def summary(self, budget: int | None) -> dict | None:
        """``{"budget", "layers": {layer: {"calls", "kept", "first", "last", "worst", "nonfinite"}}}`` for the layers
        that lost calls (each role: the call kept for it, or None when that call was not kept), None when every call
        was kept."""
        if not self.dropped:
            return None
        kept: dict[str, list[int]] = {}
        for layer, k in self.roles:
            kept.setdefault(layer, []).append(k)
        layers = {}
        for layer, n in self.calls.items():
            mine = sorted(kept.get(layer, []))
            if len(mine) == n:
                continue
            last = mine[-1] if mine and mine[-1] == n - 1 else None
            worst = self.worst.get(layer, (None,))[0]
            bad = self.nonfinite.get(layer)
            layers[layer] = {"calls": n, "kept": len(mine), "first": 0 if mine[:1] == [0] else None, "last": last,
                             "worst": worst if worst in mine else None, "nonfinite": bad if bad in mine else None,
                             "worst_lost": worst is not None and worst not in mine,
                             "nonfinite_lost": bad is not None and bad not in mine}
        return {"budget": budget, "layers": layers}


def size_text(n: int) -> str:
    """A size as people read it: ``256 MiB``, ``293 KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def kept_text(step: int, layer: str, row: dict, budget) -> str:
    """``snapshot step 0: 1,000 calls of cell, kept 4 (first, last, worst, first non-finite), 996 dropped over the
    256 MiB budget``, from one layer of a snapshot entry's ``kept``."""
    roles = [ROLE_WORDS[r] for r in ("first", "last", "worst", "nonfinite") if isinstance(row.get(r), int)]
    calls, kept = int(row.get("calls", 0)), int(row.get("kept", 0))
    text = (f"snapshot step {step}: {calls:,} calls of {layer}, kept {kept:,}"
            + (f" ({', '.join(roles)}{', and the earliest others that fit' if kept > len(roles) else ''})"
               if roles else "") + f", {calls - kept:,} dropped")
    if isinstance(budget, int):
        text += f" over the {size_text(budget)} budget"
    lost = [w for w, key in (("the worst call", "worst_lost"), ("the first non-finite call", "nonfinite_lost"))
            if row.get(key) is True]
    return text + (f" ({' and '.join(lost)} did not fit)" if lost else "")
