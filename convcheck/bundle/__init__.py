"""Run bundles: a target's run recorded on one machine (``convcheck record``), diagnosed on another
(``convcheck diff``). ``schema`` holds the format and its limits, ``writer`` writes a bundle (arrays
streamed to disk layer by layer), ``reader`` validates one field by field (a hostile bundle is a
one-line ``UsageError``), ``record`` runs one target and writes its bundle, ``diff`` rebuilds a
``CompareResult`` from two bundles and a judge."""

from convcheck.runformat.schema import SCHEMA

__all__ = ["SCHEMA"]
