"""This folder is a checkout of millpond's source, not the ``millpond`` package.

Python imports this file as ``millpond`` only when the checkout's folder is named
``millpond`` and the folder holding it comes first on ``sys.path``: a script kept there, or
``python -c`` or the REPL started there. Without this file Python would make the checkout an
empty namespace package, and ``millpond.MmapReplayBuffer`` would fail with "module
'millpond' has no attribute ..." even with millpond installed: ``pip install -e`` (with the
two source folders, client/ and server/) installs a finder that Python asks only after
every folder on ``sys.path``, and a namespace package found there ends the search.

So, imported as ``millpond``, this file hands the import to the millpond this Python would
import from any other folder (installed, editable, or on ``PYTHONPATH``), which then is
``sys.modules["millpond"]`` and what ``import millpond`` returns; where there is none, it
raises an ImportError that says what to do. Under any other name it does nothing: pytest
imports it as the checkout's root package, named after the folder.

It is no part of the package: pyproject.toml packages client/millpond and
server/millpond_server only (tests/test_release.py checks all of this).
"""

import importlib.machinery
import importlib.util
import os
import sys


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _millpond_elsewhere(checkout: str):  # -> ModuleSpec | None
    """The spec the import system gives ``millpond`` when the folder holding the checkout is
    not searched: each finder of ``sys.meta_path`` asked in turn, as the import system does."""
    outer = os.path.dirname(checkout)
    path = [entry for entry in sys.path if not _same(entry or os.curdir, outer)]
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec("millpond", path)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec("millpond", None)
        else:
            continue
        # Neither a namespace portion (no loader) nor this file again
        if spec is not None and spec.loader is not None and not (
                spec.origin and _same(spec.origin, __file__)):
            return spec
    return None


def _not_installed(checkout: str) -> ImportError:
    python = sys.executable or "python"
    own = os.path.join(checkout, ".venv", "bin", "python")
    return ImportError(
        f"millpond is not installed for this Python ({python}): 'import millpond' found "
        f"{checkout}, a checkout of millpond's source, which is not the package. Install it "
        f"('{python} -m pip install -e {checkout}'), or use a Python that has it (such as "
        f"{own}, which `make run` makes), or run from another folder.",
        name="millpond")


if __name__ == "millpond":
    _checkout = os.path.dirname(os.path.realpath(__file__))
    _spec = _millpond_elsewhere(_checkout)
    if _spec is None:
        raise _not_installed(_checkout)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["millpond"] = _module  # what `import millpond` returns, this module's import done
    _spec.loader.exec_module(_module)
