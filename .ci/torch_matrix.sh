#!/usr/bin/env bash
# The torch version matrix, beside `make test` on the pinned torch (2.13): the oldest
# supported release (2.9), 2.10, 2.11 (the CUDA 13 images) and the newest (2.15), each the package
# registry's wheel in a venv of its own, run the compatibility subset: the op tables
# against that torch's registrations, the list, torch-boundary, architecture and compile
# tests, and every level's training smoke on the CPU. Each venv also holds one end of the
# integrations' supported ranges (pyproject's extras): the oldest Lightning, transformers
# and Accelerate beside torch 2.9, 2.10 and 2.11, the newest beside 2.15, and runs the three
# integration test files; the newest release also gets the built wheel installed beside
# its torch (.ci/wheel_check.sh). One summary line per release at the end; exit 1 if any
# release failed a check. The next release's venv is installed in the background while
# one release's checks run.
set -uo pipefail
cd "$(dirname "$0")/.."
RELEASES="${AMPKIT_TORCH_MATRIX:-2.9.1 2.10.0 2.11.0 2.15.0}"
# the ends of the extras' ranges (keep in step with pyproject.toml)
frameworks_for() {
    case "$1" in
        2.9.* | 2.10.* | 2.11.*) echo "lightning==2.5.0.post0 transformers==5.20.0 accelerate==1.12.0" ;;
        *) echo "lightning==2.6.6 transformers==5.25.0 accelerate==1.16.0" ;;
    esac
}
install() {  # the venv of release $1 with what it needs (kept when it already holds it)
    local v="$1" venv=".venv-torch-$1"
    local want="torch==$v $(frameworks_for "$v") pytest-xdist"
    [ "$(cat "$venv/.installed" 2>/dev/null)" = "$want" ] && return 0
    rm -rf "$venv"
    python3 -m venv "$venv" || return 1
    # the registry's CUDA wheel (it runs on the CPU); lift the machines' torch cap for this command
    # shellcheck disable=SC2046  # the framework pins are separate words
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q "torch==$v" numpy pytest pytest-timeout "pytest-xdist>=3.5,<4" \
        hypothesis "import-linter>=2.17,<3" rich matplotlib scikit-learn $(frameworks_for "$v") || return 1
    echo "$want" > "$venv/.installed"
}
summary=()
status=0
read -r -a queue <<< "$RELEASES"
fetching=""  # the background install of the next release (its download overlaps this one's tests)
for i in "${!queue[@]}"; do
    v="${queue[$i]}"
    venv=".venv-torch-$v"
    [ -n "$fetching" ] && { wait "$fetching" || true; }
    start=$(date +%s)
    installed=1
    install "$v" || installed=0  # at once where the background install did it
    next="${queue[$((i + 1))]:-}"
    fetching=""
    if [ -n "$next" ]; then
        install "$next" > "torch-matrix-$next-install.log" 2>&1 &
        fetching=$!
    fi
    if [ "$installed" = 0 ]; then
        echo "torch-matrix: torch $v could not be installed" >&2
        summary+=("torch $v: NOT INSTALLED")
        status=1
        continue
    fi
    export PYTHONPATH=src OMP_NUM_THREADS=1
    ok=1
    log="torch-matrix-$v"
    "$venv/bin/python" -m ampkit.casting.lists.generate --check 2>&1 | tee "$log-check.log" || ok=0
    # both cores, one test file per worker (as make test runs them)
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder tests/unit/casting/test_lists.py tests/unit/_internal/test_torch_compat.py \
        tests/unit/_internal/test_inductor_compat.py tests/tools/test_warmup.py tests/meta/test_architecture.py tests/unit/casting/test_compile.py 2>&1 | tee "$log-subset.log" || ok=0
    "$venv/bin/python" benchmarks/gpu_smoke.py --device cpu --steps 12 --json "$log.json" || ok=0
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder tests/integrations/test_integration_hf.py \
        tests/integrations/test_integration_accelerate.py tests/integrations/test_integration_lightning.py 2>&1 | tee "$log-integrations.log" || ok=0
    unset PYTHONPATH
    if [ "$v" = "${RELEASES##* }" ]; then  # the newest torch: the built wheel installed beside it
        PIP_CONSTRAINT=/dev/null AMPKIT_WHEEL_VENV="$venv" bash .ci/wheel_check.sh 2>&1 | tee "$log-wheel.log" || ok=0
    fi
    took=$(( $(date +%s) - start ))
    "$venv/bin/python" .ci/matrix_report.py record --release "$v" --summary torch-matrix-summary.json \
        --check-log "$log-check.log" --subset-log "$log-subset.log" --smoke-json "$log.json" \
        --integrations-log "$log-integrations.log" --seconds "$took" --ok "$ok" || status=1
    if [ "$ok" = 1 ]; then summary+=("torch $v: passed (${took} s)"); else summary+=("torch $v: FAILED (${took} s)"); status=1; fi
done
echo "torch-matrix:"
printf '  %s\n' "${summary[@]}"
# the supported-versions page of this run (docs/versions.md is a recorded copy)
python3 .ci/matrix_report.py render torch-matrix-summary.json torch-matrix.md && cat torch-matrix.md
exit $status
