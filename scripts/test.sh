#!/usr/bin/env bash
# Install what the tests need, then run them all: pure policy tests, LoRA math on the tiny model,
# and the real embedded stack (Postgres, Redis, API, trainer, Celery) driven over HTTP and the SDK.
#
#   ./scripts/test.sh            everything (CI runs this)
#   ./scripts/test.sh --quick    the fast tier: no embedded stack, no other processes, no vLLM engine
#                                (pytest markers `stack` and `engine`); skips the install when .venv is there
# Any other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
quick=0
for arg in "$@"; do
  if [ "$arg" = --quick ]; then quick=1; else args+=("$arg"); fi
done
if [ "$quick" = 0 ] || [ ! -x .venv/bin/python ]; then
  bash scripts/install.sh
fi
export HF_HUB_OFFLINE=1
if [ "$quick" = 1 ]; then
  args=(-m "not stack and not engine" ${args[@]+"${args[@]}"})
fi
exec .venv/bin/python -m pytest -q ${args[@]+"${args[@]}"}
