"""The ``convcheck`` command line: one module per command; ``main`` parses and dispatches."""
