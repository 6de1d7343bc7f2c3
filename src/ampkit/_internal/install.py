"""The install line for one of ampkit's extras, as a message can give it.

ampkit is installed from its clone (``pip install -e .``) or a wheel built from it, not
from the package registry, so ``pip install 'ampkit[lightning]'`` would find nothing:
a message names the extra's own requirements, read from the installed package's metadata
(``lightning>=2.5,<2.7``), and the line for a clone.
"""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["install_hint"]


def extra_requirements(extra: str) -> list[str]:
    """The requirements ampkit's metadata lists for ``extra`` (empty when ampkit runs
    from its source folder without being installed)."""
    try:
        requires = metadata.requires("ampkit") or []
    except metadata.PackageNotFoundError:
        return []
    marker = re.compile(r"""extra\s*==\s*["']""" + re.escape(extra) + r"""["']""")
    return [r.split(";", 1)[0].strip() for r in requires if ";" in r and marker.search(r.split(";", 1)[1])]


def install_hint(extra: str) -> str:
    """``"pip install 'lightning>=2.5,<2.7' (ampkit's 'lightning' extra; from ampkit's clone:
    pip install -e '.[lightning]')"``; without metadata, the clone's line alone."""
    clone = f"pip install -e '.[{extra}]' in ampkit's clone"
    reqs = extra_requirements(extra)
    if not reqs:
        return clone
    quoted = " ".join(f"'{r}'" for r in reqs)
    return f"pip install {quoted} (ampkit's {extra!r} extra; or {clone})"
