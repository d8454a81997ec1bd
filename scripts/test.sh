#!/usr/bin/env bash
# Install what the tests need, then run them all: pure policy tests, LoRA math on the tiny model,
# and the real embedded stack (Postgres, Redis, API, trainer, Celery) driven over HTTP and the SDK.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
