"""The analysis of watched runs, beside ``diagnose/``: two runs (or one and the float64 judge) read from
``runformat/``, measured and handed to ``diagnose`` as evidence.

``diff`` (two runs aligned step by step; one against the judge), ``verdict`` (the evidence gathered, the rules
asked), ``run_lines`` (the lines shown beside the measurements), ``replay`` (the float64 judge replaying each
snapshot step's leaf calls), ``model_import`` (a run's model class imported safely), ``backends`` (a compiled
run bisected over torch.compile's backends), ``rankdiff`` (a DDP run's ranks), ``worlddiff`` (a DDP rank against a run of another world size), ``tables`` (the dump-diff tables)."""
