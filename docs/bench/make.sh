#!/usr/bin/env bash
# The example report in this folder, on a 2-core CPU machine with the default model (about 50 minutes):
# each point three times (--repeats 3, seeds 0-2) for medians with 95% intervals; the goodput search,
# the link study and the plan run once. SLOs fit the AVX2 machine; on a faster CPU tighten them.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf docs/bench/chat docs/bench/summarize  # no plot of an earlier run left beside the new ones
python -m minipd bench --quick --workloads chat --rates 0.5,1,2 --num-prompts 24 --repeats 3 \
    --modes colocated,chunked:64,disagg:1p1d --slo-ttft-ms 1500 --slo-tpot-ms 75 \
    --goodput-search --search-max-runs 3 --kv-link-gbps 0.1,0.3,1,10 --plan --no-progress --out docs/bench/chat
python -m minipd bench --quick --workloads summarize --rates 0.1,0.25 --num-prompts 8 --repeats 3 \
    --modes colocated,chunked:64,disagg:1p1d --slo-ttft-ms 10000 --slo-tpot-ms 250 \
    --goodput-search --search-max-runs 3 --plan --no-progress --out docs/bench/summarize
