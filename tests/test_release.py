"""What a release is made of (README, "Releasing"): one version, read by every
part; a changelog with a section for it; extras the README names; and a checkout that
cannot hide the installed package when Python is run from the folder that holds it.

The wheel itself is checked by `make test-wheel` (tests/wheel_smoke.py, in CI): it needs a
build and a fresh venv, more than a test here should.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import millpond
from millpond import _version
from millpond.core import bufferfile
from millpond_server.compat import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = _version.__version__


def run(args: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


# ---- one version ------------------------------------------------------------------

def test_the_version_is_written_in_one_place_and_pyproject_reads_it():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "millpond._version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", VERSION), VERSION
    # Nothing else says a version of its own, nor asks the installed metadata (which a
    # checkout on PYTHONPATH lacks, or has from another checkout)
    for path in [*ROOT.glob("client/**/*.py"), *ROOT.glob("server/**/*.py"), *ROOT.glob("bench/*.py")]:
        text = path.read_text()
        if path != ROOT / "client/millpond/_version.py":
            assert not re.search(r"^\s*__version__\s*=", text, re.M), path
        assert 'version("millpond")' not in text, path


def test_the_package_the_command_and_the_engine_say_the_same_version():
    assert millpond.__version__ == VERSION
    assert bufferfile._version() == VERSION  # in "made by a newer millpond" errors
    # (the daemon's millpond_build_info metric: tests/test_metrics.py; the benchmark's
    # header prints millpond.__version__)
    for args in ([sys.executable, "-m", "millpond_server", "--version"],
                 [sys.executable, "-c", "import millpond_server, sys; sys.exit(millpond_server.main())",
                  "--version"]):
        done = run(args, ROOT)
        assert (done.returncode, done.stdout, done.stderr) == (0, f"millpond {VERSION}\n", ""), args


def test_the_millpond_command_prints_the_version():
    command = Path(sys.executable).parent / "millpond"
    if not command.exists():
        pytest.skip(f"no millpond command beside {sys.executable} (millpond not installed)")
    # Its millpond_server is this checkout's wherever PYTHONPATH puts it first
    done = run([command, "--version"], ROOT)
    assert (done.returncode, done.stdout) == (0, f"millpond {VERSION}\n"), done.stderr


# ---- changelog ----------------------------------------------------------------------

def changelog_sections() -> list[str]:
    return re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_the_changelog_has_a_section_for_this_version_or_unreleased():
    sections = changelog_sections()
    assert sections and sections[0] in ("Unreleased", VERSION), sections
    assert VERSION in sections or sections[0] == "Unreleased", (VERSION, sections)
    text = (ROOT / "CHANGELOG.md").read_text()
    released = [s for s in sections if s != "Unreleased"]
    for version in released:  # Keep a Changelog: "## [X.Y.Z] - YYYY-MM-DD", newest first
        assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M), version
    key = [tuple(int(n) for n in re.findall(r"\d+", v)[:3]) for v in released]
    assert key == sorted(key, reverse=True), released


# ---- extras ----------------------------------------------------------------------------

def test_the_readme_names_every_extra_and_the_server_needs_none():
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([a-z0-9]+)` \|", install, re.M))
    assert named == set(PYPROJECT["project"]["optional-dependencies"]), named
    required = {re.split(r"[<>=;\[ ]", dep, maxsplit=1)[0] for dep in PYPROJECT["project"]["dependencies"]}
    assert not required & {"torch", "stable-baselines3", "minari", "h5py", "prometheus-client"}, required
    run_target = re.search(r"^\$\(RUN_STAMP\):.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert "pip install --quiet -e .\n" in run_target.group(1), run_target.group(1)


# ---- the folder that holds a checkout -----------------------------------------------------

@pytest.fixture
def outer(tmp_path: Path) -> Path:
    """A folder holding a checkout named millpond, as `git clone` names it (of the checkout,
    the file Python finds there is enough)."""
    shutil.copy(ROOT / "__init__.py", _mkdir(tmp_path / "millpond"))
    return tmp_path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


USE = "import millpond; print(millpond.__file__); print(millpond.MmapReplayBuffer.__name__)"


def test_from_the_folder_holding_a_checkout_import_millpond_is_the_installed_one(outer):
    """Python run there finds the checkout first: it hands the import on to the millpond
    this Python imports from anywhere else (here: the one these tests import)."""
    done = run([sys.executable, "-c", USE], outer)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [millpond.__file__, "MmapReplayBuffer"]
    # A script kept there (sys.path[0] is its folder, not ""), its submodule imported first
    (outer / "script.py").write_text("import millpond.core\n" + USE.replace("; ", "\n"))
    done = run([sys.executable, "script.py"], outer)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [millpond.__file__, "MmapReplayBuffer"]


def test_from_there_an_editable_install_is_found_too(outer):
    """Without PYTHONPATH: the millpond of this Python's own install, an editable one in the
    venv of `make venv` (whose finder Python asks after every folder of sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    elsewhere = run([sys.executable, "-c", "import millpond; print(millpond.__file__)"], ROOT.parent, env)
    if elsewhere.returncode != 0 or elsewhere.stdout.strip() == "None":
        pytest.skip(f"millpond is not installed for {sys.executable}")
    done = run([sys.executable, "-c", USE], outer, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [elsewhere.stdout.strip(), "MmapReplayBuffer"]


def test_from_there_without_millpond_installed_the_error_says_what_to_do(outer):
    # -S: no site-packages, so neither an install nor an editable finder (nor PYTHONPATH)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = run([sys.executable, "-S", "-c", USE], outer, env)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: millpond is not installed for this Python"), done.stderr
    checkout = os.path.realpath(outer / "millpond")
    assert "a checkout of millpond's source, which is not the package" in last
    assert f"-m pip install -e {checkout}" in last and "run from another folder" in last


def test_under_another_name_the_file_does_nothing(tmp_path):
    """pytest imports it as the root package of the checkout, named after its folder."""
    shutil.copy(ROOT / "__init__.py", _mkdir(tmp_path / "checkout"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = run([sys.executable, "-S", "-c", "import checkout, sys; print('millpond' in sys.modules)"],
               tmp_path, env)
    assert (done.returncode, done.stdout) == (0, "False\n"), done.stderr
