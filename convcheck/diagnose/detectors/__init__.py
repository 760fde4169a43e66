"""Detectors: read the parity table, the training curves and the recipe; return ``Symptom`` records."""
