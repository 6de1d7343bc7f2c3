#!/usr/bin/env bash
# The package as a user installs it, after `make test` (whose venv has build and twine):
# `python -m build` makes the sdist and, from it, the wheel; `twine check --strict` reads
# both. A fresh venv (no system site-packages) gets the Makefile's pinned torch the way
# `make test` installs it, then `pip install` of the wheel alone (as the install docs say:
# pip must keep that torch, which is checked). From a folder outside the source tree,
# `ampkit --version` must print the package's version, every op table must load from the
# installed package, and the README's quick start must print what the README shows
# (.ci/readme_quickstart.py). One summary line; exit 1 on a failure; the venv and the
# build are deleted at the end. About a minute on 2 cores, most of it installing torch.
# With AMPKIT_WHEEL_VENV=DIR (the torch matrix, for its newest torch) the wheel goes into
# that existing venv instead (its torch kept, checked alike) and is uninstalled after.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$(date +%s)
py=${AMPKIT_BUILD_PYTHON:-$root/.venv/bin/python}  # the venv `make test` built (the test extra)
torch_pin=$(sed -n 's/^TORCH *:= *//p' Makefile)    # torch==2.13.0, as `make test` installs it
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
work=$(mktemp -d "${TMPDIR:-/tmp}/ampkit-wheel-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
unset PYTHONPATH

fail() {
    echo "wheel-check: FAILED ($(( $(date +%s) - start )) s): $*"
    exit 1
}

# the sdist, then the wheel built from it (what a user of the sdist gets); no build
# isolation: the build-system's setuptools comes from the venv, nothing is downloaded
"$py" -m build --no-isolation --outdir "$work/dist" . > "$work/build.log" 2>&1 ||
    { tail -n 30 "$work/build.log"; fail "python -m build"; }
wheel="$work/dist/ampkit-$version-py3-none-any.whl"
sdist="$work/dist/ampkit-$version.tar.gz"
[ -f "$wheel" ] && [ -f "$sdist" ] || fail "no ampkit-$version wheel and sdist in: $(ls "$work/dist")"
"$py" -m twine check --strict "$wheel" "$sdist" > "$work/twine.log" 2>&1 || { cat "$work/twine.log"; fail "twine check"; }

pip_log="$work/pip.log"
venv=${AMPKIT_WHEEL_VENV:-$work/venv}
if [ -n "${AMPKIT_WHEEL_VENV:-}" ]; then  # an existing venv with its own torch
    venv=$(cd "$AMPKIT_WHEEL_VENV" && pwd)
    trap '"$venv/bin/python" -m pip uninstall -q -y ampkit > /dev/null 2>&1; rm -rf "$work"' EXIT
else  # a fresh venv with the pinned torch, installed as the Makefile's $(VENV)/.installed does
    "${PYTHON:-python3}" -m venv "$venv"
    grep -q '^include-system-site-packages = false' "$venv/pyvenv.cfg" || fail "the venv sees system site-packages"
    "$venv/bin/python" -m pip install -q --upgrade pip >> "$pip_log" 2>&1 || { tail -n 30 "$pip_log"; fail "pip upgrade"; }
    "$venv/bin/python" -m pip install -q "$torch_pin" >> "$pip_log" 2>&1 || { tail -n 30 "$pip_log"; fail "pip install $torch_pin"; }
fi
vpy="$venv/bin/python"
torch_before=$("$vpy" -W ignore -c 'import torch; print(torch.__version__)')
"$vpy" -m pip install -q "$wheel" >> "$pip_log" 2>&1 || { tail -n 30 "$pip_log"; fail "pip install of the wheel"; }
torch_after=$("$vpy" -W ignore -c 'import torch; print(torch.__version__)')
[ "$torch_before" = "$torch_after" ] || fail "installing the wheel moved torch from $torch_before to $torch_after"
if [ -z "${AMPKIT_WHEEL_VENV:-}" ]; then
    "$vpy" -m pip check > /dev/null || fail "pip check: $("$vpy" -m pip check)"
else  # an existing venv: only what concerns ampkit (its other packages are not ours to judge)
    broken=$("$vpy" -m pip check 2>&1 | grep -i ampkit || true)
    [ -z "$broken" ] || fail "pip check: $broken"
fi

# outside the source tree: the installed package, its command and its data files
mkdir "$work/run"
cd "$work/run"
# stderr (torch's own notices, e.g. that numpy is absent: the core needs torch alone) to a log
log="$work/run.log"
where=$("$vpy" -c 'import ampkit; print(ampkit.__file__)' 2>> "$log") || { cat "$log"; fail "import ampkit"; }
case "$where" in "$venv/"*) ;; *) fail "ampkit imported from $where, not from the venv" ;; esac
shown=$("$venv/bin/ampkit" --version 2>> "$log") || { cat "$log"; fail "ampkit --version"; }
case "$shown" in "ampkit $version "*) ;; *) fail "ampkit --version printed '$shown', not ampkit $version" ;; esac
"$vpy" -c 'from ampkit.casting import lists
missing = sorted(set(lists.RELEASES) - set(lists.TABLES))
assert not missing, f"op tables missing from the installed package: {missing}"' 2>> "$log" ||
    { cat "$log"; fail "the op tables"; }
quickstart=$("$py" "$root/.ci/readme_quickstart.py" "$root/README.md" --python "$vpy" --workdir "$work/run") ||
    { echo "$quickstart"; fail "the README's quick start"; }

echo "wheel-check: passed ($(( $(date +%s) - start )) s): ampkit-$version sdist and wheel pass twine check;" \
    "the wheel installed beside torch $torch_after (kept) prints '$shown';" \
    "the op tables load; ${quickstart#readme-quickstart: }"
