#!/usr/bin/env bash
# SGLang's streamed chunks: deltas (--incremental-streaming-output, what rollopt's servers now use) against
# SGLang's default cumulative chunks (every chunk resends all earlier tokens and logprobs: O(n^2) per request),
# side by side on the real CPU server, alternated twice (A B A B), 3 interleaved repeats of two policies each.
# Writes bench/results/sglang-stream-{cumulative,incremental}-{1,2}.json. About 6 minutes on the 2-core VM.
set -euo pipefail
cd "$(dirname "$0")/.."
for round in 1 2; do
  for mode in cumulative incremental; do
    incremental=$([ "$mode" = incremental ] && echo true || echo false)
    .venv/bin/rollopt bench -q --engine sglang --engine-option "incremental_stream=$incremental" \
      --workload long-tail --schedulers async,overlap+prefix+preempt --repeats 3 \
      --json "bench/results/sglang-stream-$mode-$round.json"
  done
done
