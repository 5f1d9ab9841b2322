#!/usr/bin/env bash
# The example report in this folder, on a 2-core CPU machine with the default model (about 45 minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m minipd bench --quick --workloads chat --rates 0.5,1,2 --num-prompts 24 \
    --modes colocated,chunked:64,disagg:1p1d --slo-ttft-ms 1000 --slo-tpot-ms 35 \
    --goodput-search --search-max-runs 4 --kv-link-gbps 0.1,0.3,1,10 --plan --no-progress --out docs/bench/chat
python -m minipd bench --quick --workloads summarize --rates 0.15,0.3,0.5 --num-prompts 12 \
    --modes colocated,chunked:64,disagg:1p1d --slo-ttft-ms 8000 --slo-tpot-ms 150 \
    --goodput-search --search-max-runs 4 --kv-link-gbps 0.1,0.3,1,10 --plan --no-progress --out docs/bench/summarize
