#!/usr/bin/env bash
# Perplexity throughput of ikcli and (optionally) a reference llama-perplexity on the same file:
#   scripts/bench_perplexity.sh MODEL.gguf TEXT CTX CHUNKS THREADS [REF_BIN [REF_ARGS...]]
# Prints wall seconds and tokens/s (CHUNKS·CTX tokens evaluated) for each tool, in one run.
set -euo pipefail
model=$1 text=$2 ctx=$3 chunks=$4 threads=$5
shift 5
ref=${1:-}
[ $# -gt 0 ] && shift
run() {
  local name=$1; shift
  local t0 t1
  t0=$(date +%s.%N)
  "$@" -m "$model" -f "$text" -c "$ctx" --chunks "$chunks" -t "$threads" >/tmp/bench_ppl.out 2>/tmp/bench_ppl.err
  t1=$(date +%s.%N)
  python3 - "$name" "$t0" "$t1" "$ctx" "$chunks" <<'PY'
import sys, re
name, t0, t1, ctx, chunks = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
out = open("/tmp/bench_ppl.out").read()
m = re.search(r"Final estimate: PPL(?: over \d+ chunks for n_ctx=\d+)? = (\d+\.\d+)", out)
wall = t1 - t0
print(f"{name:10s} wall {wall:8.2f} s   {chunks * ctx / wall:9.1f} tokens/s (incl. load)   PPL {m.group(1) if m else '?'}")
PY
}
run ikcli "$(dirname "$0")/../.venv/bin/ikcli" perplexity
if [ -n "$ref" ]; then
  run reference "$ref" "$@"
fi
