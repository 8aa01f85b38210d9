#!/usr/bin/env bash
# The main job on the built-in real models: a server verifies with Qwen2.5-Coder-1.5B,
# an edge drafts with Qwen2.5-Coder-0.5B, and the answer streams to the terminal.
# Then the same question server-only, to show the output is token-identical, and the speed of each.
#
# One box plays two machines: the server and the edge are pinned to separate cores (taskset), in both
# runs, so that drafting never takes the cores the verify runs on, as on two machines. What one box
# cannot show (a GPU's batch economics, the network) is in the README, "One box".
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
PORT="${PORT:-50051}"
PROMPT="${1:-Write a Python function that returns the n-th Fibonacci number.}"
LOG="$(mktemp -t specedge-server.XXXXXX.log)"
OUT="$(mktemp -d -t specedge-demo.XXXXXX)"

cpus="$(nproc)"
server_pin=() edge_pin=() edge_threads=()
if [ "$cpus" -ge 2 ] && command -v taskset >/dev/null; then
    half=$((cpus / 2))
    server_cpus="0-$((half - 1))" edge_cpus="$half-$((cpus - 1))"
    [ "$half" -eq 1 ] && server_cpus=0
    [ "$cpus" -eq $((half + 1)) ] && edge_cpus="$half"
    server_pin=(taskset -c "$server_cpus")
    edge_pin=(taskset -c "$edge_cpus")
    edge_threads=(--threads "$((cpus - half))")
    export OMP_NUM_THREADS="$half"  # the server's torch threads: its own cores
    echo "one box as two machines: the server runs on CPUs $server_cpus, the edge on CPUs $edge_cpus" \
        "(separate cores, in both runs)" >&2
else
    echo "one box, one core (or no taskset): the edge's drafting shares the server's core, so the speed-up" \
        "below understates two machines" >&2
fi

echo "starting specedge-server (the first start assembles and converts the 1.5B model once, ~2 min)..." >&2
"${server_pin[@]}" "$BIN/specedge-server" --model qwen2.5-coder-1.5b --port "$PORT" >"$LOG" 2>&1 &
server=$!
unset OMP_NUM_THREADS
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
until grep -q "specedge-server ready on" "$LOG"; do
    kill -0 $server 2>/dev/null || { echo "server failed to start; see $LOG" >&2; tail -5 "$LOG" >&2; exit 1; }
    sleep 1
done
grep "specedge-server ready on" "$LOG" >&2

# The edge has cores of its own, so it drafts ahead while the server verifies (--proactive; on one
# unpinned box that is off by default, since it would slow the verify it waits for).
echo "--- speculative: the edge drafts with the 0.5B, the server verifies with the 1.5B (streamed):" >&2
"${edge_pin[@]}" "$BIN/specedge-edge" --server "127.0.0.1:$PORT" --draft qwen2.5-coder-0.5b "${edge_threads[@]}" \
    --proactive --prompt "$PROMPT" --max-tokens 96 --stats 2>"$OUT/spec.stats" | tee "$OUT/spec.txt"
cat "$OUT/spec.stats" >&2
echo "--- server-only: the 1.5B alone, for comparison:" >&2
"${edge_pin[@]}" "$BIN/specedge-edge" --server "127.0.0.1:$PORT" --server-only --prompt "$PROMPT" --max-tokens 96 \
    --stats >"$OUT/alone.txt" 2>"$OUT/alone.stats"
cat "$OUT/alone.stats" >&2

speed() { sed -n 's/.*tokens, \([0-9.]*\) tok\/s.*/\1/p' "$1" | tail -1; }
spec_speed="$(speed "$OUT/spec.stats")" alone_speed="$(speed "$OUT/alone.stats")"
ratio="$(awk -v a="$spec_speed" -v b="$alone_speed" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "-" }')"
if cmp -s "$OUT/spec.txt" "$OUT/alone.txt"; then
    echo "identical to the target alone: yes; speed $spec_speed tok/s speculative vs $alone_speed tok/s" \
        "server-only: $ratio" >&2
else
    echo "identical to the target alone: NO (see $OUT); speed $spec_speed vs $alone_speed tok/s: $ratio" >&2
    exit 1
fi
