#!/usr/bin/env bash
# `make test-pythons` (the Makefile sets PYTHONS, FAST, FAST_SKIP and SMOKE): on each CPython
# of PYTHONS found on this machine, in a venv of its own (.venv-X.Y) holding millpond and its
# light `test` extra only, the fast suite and then the daemon smoke tests. A Python that is
# not here is said and skipped; any failure fails the whole, after every Python has run.
set -uo pipefail
: "${PYTHONS:?}" "${FAST:?}" "${FAST_SKIP?}" "${SMOKE:?}"  # run by `make test-pythons`
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH  # each venv's editable install is the millpond it tests

candidates() {  # X.Y -> possible interpreters, one a line: on PATH, then pyenv's, newest first
    command -v "python$1" 2>/dev/null || true
    local root
    root=$(pyenv root 2>/dev/null) || root=${PYENV_ROOT:-$HOME/.pyenv}
    ls -d "$root/versions/$1".*/bin/python 2>/dev/null | sort -rV || true
}

is_version() {  # interpreter X.Y -> whether it runs and is CPython X.Y
    "$1" -c "import sys, platform; sys.exit(platform.python_implementation() != 'CPython'
             or '%d.%d' % sys.version_info[:2] != '$2')" 2>/dev/null
}

find_python() {  # X.Y -> the path of a CPython X.Y, or fail
    local cand
    while read -r cand; do
        if [ -n "$cand" ] && is_version "$cand" "$1"; then
            echo "$cand"
            return 0
        fi
    done < <(candidates "$1")
    return 1
}

seconds() { echo $(( $(date +%s) - $1 )); }

summary=()
failed=0
for version in $PYTHONS; do
    if ! python=$(find_python "$version"); then
        echo "== Python $version: not found on this machine (PATH, pyenv): skipped" >&2
        summary+=("$version: skipped (not found)")
        continue
    fi
    venv=".venv-$version"
    echo "== Python $version: $python, in $venv"
    start=$(date +%s)
    if [ -x "$venv/bin/python" ] && ! is_version "$venv/bin/python" "$version"; then
        rm -rf "$venv"  # made by another interpreter, or broken
    fi
    stamp="$venv/.installed-test"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        log="$venv/install.log"
        if ! "$python" -m venv "$venv" \
           || ! "$venv/bin/python" -m pip install -e '.[test]' >"$log" 2>&1; then
            [ -f "$log" ] && cat "$log" >&2
            echo "== Python $version: install failed" >&2
            summary+=("$version: install FAILED")
            failed=1
            continue
        fi
        touch "$stamp"
    fi
    installed=$(seconds "$start")
    start=$(date +%s)
    # shellcheck disable=SC2086  # FAST_SKIP, SMOKE and ARGS are lists of words
    "$venv/bin/python" -m pytest -p no:cacheprovider -q -m "$FAST" $FAST_SKIP ${ARGS:-}
    fast_rc=$?
    fast=$(seconds "$start")
    start=$(date +%s)
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pytest -p no:cacheprovider -q -m daemon $SMOKE ${ARGS:-}
    smoke_rc=$?
    smoke=$(seconds "$start")
    result="fast suite $( [ $fast_rc = 0 ] && echo passed || echo FAILED ) in ${fast} s,"
    result+=" smoke $( [ $smoke_rc = 0 ] && echo passed || echo FAILED ) in ${smoke} s"
    summary+=("$version: $result (venv ready in ${installed} s)")
    if [ $fast_rc != 0 ] || [ $smoke_rc != 0 ]; then
        failed=1
    fi
done

echo "== test-pythons:"
printf '   %s\n' "${summary[@]}"
exit $failed
