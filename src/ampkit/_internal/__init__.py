"""Small facts every layer shares: dtype tables, state-dict validation, warning
locations, the reset registry, script running, output paths. Imports nothing of
ampkit but :mod:`ampkit.errors`."""
