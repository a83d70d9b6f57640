"""The optional packages the tests need (pyproject's extras): a test whose package is absent skips, naming the extra
that installs it, instead of erroring. At tests/ root like numerics.py, importable from every test folder.

``@needs("aiohttp")`` (or ``pytestmark = needs(...)``) marks a test or a file; a file whose own imports need the
package starts with ``pytest.importorskip(module, reason=install_line(module))`` instead, so that it collects.
"""

from __future__ import annotations

import importlib.util

import pytest

from trtpipe.extras import EXTRAS

# top-level module -> the trtpipe extra that installs it: the product's table, plus the oracle and deploy packages
# only the tests import
EXTRA_OF: dict[str, str] = {
    **{module: extra for module, (_, extra) in EXTRAS.items() if extra},
    "modelopt": "oracle",
    "compressed_tensors": "oracle",
    "kubernetes_validate": "deploy",
    "jsonschema": "deploy",
}


def absent(*modules: str) -> list[str]:
    """The top-level ``modules`` that are not installed."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def install_line(*modules: str) -> str:
    """``pip install 'trtpipe[serve,oracle]'``: the extras that bring ``modules``."""
    return f"pip install 'trtpipe[{','.join(sorted({EXTRA_OF[m] for m in modules}))}]'"


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip unless every top-level module of ``modules`` is installed; the reason names the missing ones."""
    gone = absent(*modules)
    return pytest.mark.skipif(bool(gone), reason=f"needs {', '.join(gone)}: {install_line(*gone)}" if gone else "")
