#!/usr/bin/env bash
# The main job on the built-in real models: a server verifies with Qwen2.5-Coder-1.5B,
# an edge drafts with Qwen2.5-Coder-0.5B, and the answer streams to the terminal.
# Then the same question server-only, to show the output is token-identical.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
PORT="${PORT:-50051}"
PROMPT="${1:-Write a Python function that returns the n-th Fibonacci number.}"
LOG="$(mktemp -t specedge-server.XXXXXX.log)"

echo "starting specedge-server (the first start assembles and converts the 1.5B model once, ~2 min)..." >&2
"$BIN/specedge-server" --model qwen2.5-coder-1.5b --port "$PORT" >"$LOG" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
until grep -q "specedge-server ready on" "$LOG"; do
    kill -0 $server 2>/dev/null || { echo "server failed to start; see $LOG" >&2; tail -5 "$LOG" >&2; exit 1; }
    sleep 1
done
grep "specedge-server ready on" "$LOG" >&2

echo "--- speculative: the edge drafts with the 0.5B, the server verifies with the 1.5B (streamed):" >&2
"$BIN/specedge-edge" --server "127.0.0.1:$PORT" --draft qwen2.5-coder-0.5b --prompt "$PROMPT" --max-tokens 96 \
    --stats | tee /tmp/specedge-demo-spec.txt
echo "--- server-only: the 1.5B alone, for comparison:" >&2
"$BIN/specedge-edge" --server "127.0.0.1:$PORT" --server-only --prompt "$PROMPT" --max-tokens 96 \
    --stats >/tmp/specedge-demo-alone.txt
if cmp -s /tmp/specedge-demo-spec.txt /tmp/specedge-demo-alone.txt; then
    echo "identical to the target alone: yes" >&2
else
    echo "identical to the target alone: NO (see /tmp/specedge-demo-*.txt)" >&2
    exit 1
fi
