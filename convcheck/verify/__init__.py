"""Verified remedies (issue 24): a non-``ok`` verdict's remedies applied as actions and the failing arm
re-run, so that the verdict says ``verified`` or ``not verified``. ``actions`` (what a remedy does),
``run`` (the re-runs), ``result`` (``Verification``), ``bisect`` (the smallest set of modules kept in
float32)."""

from convcheck.verify.actions import ACTIONS, Action, Context, actions_for
from convcheck.verify.float32 import keep_in_float32
from convcheck.verify.result import NO_ACTION, NOT_VERIFIED, SKIPPED, VERIFIED, Attempt, Verification
from convcheck.verify.run import verify_verdict

__all__ = ["ACTIONS", "Action", "Attempt", "Context", "NOT_VERIFIED", "NO_ACTION", "SKIPPED", "VERIFIED",
           "Verification", "actions_for", "keep_in_float32", "verify_verdict"]
