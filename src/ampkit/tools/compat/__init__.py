"""Compatibility layers for code written against other mixed-precision libraries.

- :mod:`ampkit.compat.apex`: ``from ampkit.compat.apex import amp`` replaces
  ``from apex import amp``.
"""
