"""Numbers convcheck decides with: thresholds, tolerances, error measures, number formats."""
