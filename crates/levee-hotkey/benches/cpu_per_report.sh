#!/usr/bin/env bash
# CPU time per report of one engine benchmark, from `perf stat -e task-clock`: unlike
# Criterion's wall-clock figures it does not count the time the benchmark waits for a core on
# a shared machine. The benchmark's own setup (a run whose filter matches nothing) is taken off.
#
# usage: crates/levee-hotkey/benches/cpu_per_report.sh FILTER LABEL [SECONDS]
#   FILTER   a Criterion filter, e.g. 'zipf_1m_keys/report$'
#   LABEL    the line the benchmark prints with its report count, e.g. 'zipf report'
# Build first: cargo bench -p levee-hotkey --no-run
set -euo pipefail
filter=$1
label=$2
seconds=${3:-3}
target=${CARGO_TARGET_DIR:-target}
binary=$(ls -t "$target"/release/deps/engine-* | grep -v '\.d$' | head -1)
cpu_ms() { grep task-clock | cut -d, -f1; }
base=$(perf stat -x, -e task-clock "$binary" --bench no_benchmark_matches --profile-time 1 \
    2>&1 >/dev/null | cpu_ms)
output=$(perf stat -x, -e task-clock -o /dev/stderr "$binary" --bench "$filter" \
    --profile-time "$seconds" 2>"${TMPDIR:-/tmp}/cpu_per_report.$$")
total=$(cpu_ms <"${TMPDIR:-/tmp}/cpu_per_report.$$")
rm -f "${TMPDIR:-/tmp}/cpu_per_report.$$"
reports=$(echo "$output" | grep "^$label:" | grep -oE '[0-9]+ reports' | grep -oE '[0-9]+')
awk -v total="$total" -v base="$base" -v reports="$reports" -v filter="$filter" 'BEGIN {
    ns = (total - base) * 1e6 / reports
    printf "%s: %d reports, %.1f ns CPU per report, %.2f M reports/s per core\n", filter, reports, ns, 1e3 / ns
}'
