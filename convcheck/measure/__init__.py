"""Measurements: one-step parity against the judge (``parity``) and lockstep training (``train``)."""
