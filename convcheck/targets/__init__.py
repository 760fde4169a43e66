"""Targets: what a target is (``spec``) and how it runs (``runners``: one registered class per kind)."""
