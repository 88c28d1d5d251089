"""millpond's version, written here only.

pyproject.toml reads it (``[tool.setuptools.dynamic]``), so the wheel's metadata, ``millpond
--version``, ``millpond.__version__``, the daemon's ``millpond_build_info`` metric and the
benchmark's header all say the same; a checkout run from ``PYTHONPATH`` too, where no
metadata is installed. Releasing: README, "Releasing".
"""

__version__ = "0.1.0"
