#!/usr/bin/env bash
# The test suite, from nothing: sets up .venv (idempotent), lints, runs pytest.
#   launch/test.sh            default suite (fast)
#   launch/test.sh --slow     the slow tests only (multi-process runs, long sweeps)
#   launch/test.sh --all      both: the default suite and the slow tests (what CI runs, ~20 min on 2 cores)
#   launch/test.sh -- ARGS    extra pytest arguments
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash launch/setup.sh
py="${LLMTRAIN_VENV:-$root/.venv}/bin/python"
marker=(-m "not slow")
if [ "${1:-}" = "--slow" ]; then marker=(-m slow); shift
elif [ "${1:-}" = "--all" ]; then marker=(-m "slow or not slow"); shift; fi
[ "${1:-}" = "--" ] && shift
"$py" -m ruff check llmtrain tests benchmarks tools launch
"$py" -m ruff format --check llmtrain tests benchmarks tools launch
export DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
"$py" -m llmtrain.parallel.ops --clean-shm  # 64 MiB workspaces older DeepSpeed runs left in RAM
# Two pytest-xdist workers (one torch thread each, tests/conftest.py): most of a test's time is
# one-core work (process start-up, imports, DeepSpeed init, compiling), so two at once take less
# on 2 cores (2026-12-01: 987 s, 1,185 s with a cold compile cache, against 1,406 s in one
# process). LLMTRAIN_TEST_WORKERS=0 runs in one process (e.g. to debug).
workers=(-n "${LLMTRAIN_TEST_WORKERS:-2}" --dist worksteal)
[ "${LLMTRAIN_TEST_WORKERS:-2}" = "0" ] && workers=(-p no:xdist)
set +e
"$py" -m pytest "${workers[@]}" "${marker[@]}" "$@"
rc=$?
set -e
# pytest exits 5 when a marker selects nothing; that is not a failure of the suite.
[ $rc -eq 5 ] && { echo "no tests selected"; exit 0; }
exit $rc
