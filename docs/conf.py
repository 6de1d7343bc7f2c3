"""Sphinx configuration of ampkit's documentation (``make docs``).

Pages are Markdown (MyST); the reference is autodoc on ampkit's own docstrings; the op
lists and the per-framework integration pages are generated at build time by the local
extension ``docs/_ext/ampkit_docs.py`` (into ``docs/reference/generated/``, not kept in
git); the CLI page is sphinx-argparse on ampkit's own parsers; the benchmark pages are
written by ``benchmarks/docs_pages.py`` from the JSON under ``docs/benchmarks/data/``.

The build is offline: no intersphinx. Nitpicky mode is on (``make docs`` passes ``-n``),
so every reference to ampkit's own API must resolve; references to torch, the
frameworks and the standard library are listed in ``nitpick_ignore_regex`` below.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent / "src"))  # a source checkout builds without an install

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

import ampkit  # noqa: E402

project = "ampkit"
author = "the ampkit authors"
copyright = "the ampkit authors"  # noqa: A001  (Sphinx's name)
release = ampkit.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
    "ampkit_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "benchmarks/data", "data", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# --- autodoc: typed signatures from the annotations, docstrings as written ---
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autoclass_content = "both"  # the class docstring and __init__'s
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_preprocess_types = False

# --- nitpicky: ampkit's own references must resolve; these are other projects' types ---
nitpicky = True
nitpick_ignore_regex = [
    # torch and the frameworks (no intersphinx: the build is offline)
    (r"py:.*", r"(torch|nn|optim|Tensor|Module|Optimizer|lightning|transformers|accelerate|onnx|onnxruntime|torchao)(\..*)?"),
    (r"py:.*", r"(datasets|Dataset|IterableDataset|DataLoader|LRScheduler|ReduceLROnPlateau|ProcessGroup|DeviceMesh|GradScaler_)(\..*)?"),
    (r"py:.*", r"(T|P|R|F)"),  # type variables of signatures
    # the standard library and builtins
    (r"py:.*", r"(typing|collections|collections\.abc|contextlib|enum|pathlib|os|types|threading|argparse|dataclasses|abc|warnings|re|io|json|datetime)\..*"),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|frozenset|object|type|None|True|False|NoneType|complex|slice|Ellipsis|NotImplemented|BaseException|Exception|RuntimeError|ValueError|TypeError|KeyError|ImportError|OSError|UserWarning|DeprecationWarning|RuntimeWarning|Warning)"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|MutableMapping|Sequence|Generator|Hashable|Literal|Optional|Union|Self|TypeAlias|ClassVar|Final|Protocol|NamedTuple|ContextManager|AbstractContextManager|ModuleType|MappingProxyType|Path|PathLike|Enum|IntEnum|Number|Collection|Container|Sized|Awaitable|Coroutine)"),
    (r"py:.*", r"(np|numpy)(\..*)?"),
]

# --- HTML ---
html_theme = "furo"
html_title = f"ampkit {release}"
html_static_path: list[str] = ["_static"]
html_css_files = ["ampkit.css"]  # code blocks wrap at narrow widths (1280 px and below)
html_show_sourcelink = False

# quotes and ellipses only: "--out" in prose and in the CLI page stays two hyphens
smartquotes_action = "qe"
