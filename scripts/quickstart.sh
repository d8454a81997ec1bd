#!/usr/bin/env bash
# Set everything up, start the embedded platform, create a tenant and run the SFT example.
# KEEP_RUNNING=1 leaves the platform up afterwards (Ctrl-C stops it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export QUILT_DATA_DIR=${QUILT_DATA_DIR:-$PWD/.quilt-data}
export HF_HUB_OFFLINE=1
PORT=${PORT:-8000}

quilt models create-tiny
KEY=$(quilt tenants create "demo-$(date +%s)" | tail -n 1)

quilt up --port "$PORT" &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  if curl -fs "http://127.0.0.1:$PORT/api/v1/healthz" >/dev/null 2>&1; then break; fi
  if ! kill -0 $UP 2>/dev/null; then echo "quilt up failed; logs in $QUILT_DATA_DIR/logs" >&2; exit 1; fi
  sleep 0.5
done

export QUILT_API_KEY=$KEY QUILT_BASE_URL=http://127.0.0.1:$PORT
python examples/sft_tiny.py
echo "API key for this demo tenant: $KEY"
if [ "${KEEP_RUNNING:-0}" = "1" ]; then
  echo "Quilt keeps running at $QUILT_BASE_URL; Ctrl-C stops it"
  wait $UP
fi
