#!/usr/bin/env bash
# Install what the tests need, lint and type-check, then run them all: pure policy tests, LoRA math on
# the tiny model, and the real embedded stack (Postgres, Redis, API, trainer, Celery) driven over HTTP and the SDK.
#
#   ./scripts/test.sh              everything but the extended tier, within about 45 minutes on 2 cores
#   ./scripts/test.sh --extended   only the extended tier (pytest marker `extended`): the slowest cookbook
#                                  recipe families, the vision stack and the fault runs, each minutes of real
#                                  processes; CI runs it after the above
#   ./scripts/test.sh --quick      the fast tier: no embedded stack, no other processes, no vLLM engine
#                                  (pytest markers `stack` and `engine`), no minutes-long test (`slow`)
# --quick and --extended skip the install when .venv is there. No tier runs a test marked `unproven`
# (written, not yet seen passing here: pyproject.toml).
# Both first run ruff (`ruff check .`) and mypy (`mypy`, strict over batcher/ and core/), configured in
# pyproject.toml; either failing fails the command before any test runs. Any other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
tier=full
for arg in "$@"; do
  case "$arg" in
    --quick) tier=quick ;;
    --extended) tier=extended ;;
    *) args+=("$arg") ;;
  esac
done
if [ "$tier" = full ] || [ ! -x .venv/bin/python ]; then
  bash scripts/install.sh
fi
# A .venv made before the linters joined the test extra lacks them: add just those.
if ! .venv/bin/python -c "import ruff, mypy" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet -e ".[lint]"
fi
echo "test.sh: ruff check ." >&2
.venv/bin/python -m ruff check .
echo "test.sh: mypy" >&2
.venv/bin/python -m mypy
export HF_HUB_OFFLINE=1
case "$tier" in
  quick) args=(-m "not stack and not engine and not slow and not extended and not unproven" ${args[@]+"${args[@]}"}) ;;
  extended) args=(-m "extended and not unproven" ${args[@]+"${args[@]}"}) ;;
  full) args=(-m "not extended and not unproven" ${args[@]+"${args[@]}"}) ;;
esac
exec .venv/bin/python -m pytest -q ${args[@]+"${args[@]}"}
