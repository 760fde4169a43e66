"""Renderers: terminal, JSON/CSV, plots, HTML."""
