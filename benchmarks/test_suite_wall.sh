#!/usr/bin/env bash
# Times the test suite in one process and as `make test` runs it (pytest-xdist, one worker per logical CPU, four
# at most), one after the other in this checkout, and writes the wall and CPU times with each run's last line.
# Run it on an otherwise idle machine with the venv installed (`make install`); about 25 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/test_suite_wall.md
logs=$(mktemp -d)
declare -A commands=([one-process]="-q" [make-test]="-q -n logical --maxprocesses 4")
order=(one-process make-test)
for run in "${order[@]}"; do
  # shellcheck disable=SC2086  # the options are meant to split
  /usr/bin/time -f "%e %U" -o "$logs/$run.time" .venv/bin/python -m pytest ${commands[$run]} -p no:cacheprovider \
    > "$logs/$run.log" 2>&1 || true
done
read -r serial_wall _ < "$logs/one-process.time"
{
  echo "# The test suite's wall time, in one process and as \`make test\` runs it"
  echo
  echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) logical CPUs" \
       "($(grep -o -m1 -w 'avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | xargs || true));" \
       "commit $(git rev-parse --short HEAD); $(date -u '+%Y-%m-%d %H:%M') UTC. Written by \`benchmarks/test_suite_wall.sh\`."
  echo
  echo "| run | pytest options | wall (s) | × one process | user CPU (s) | pytest's last line |"
  echo "|---|---|---:|---:|---:|---|"
  for run in "${order[@]}"; do
    read -r wall user < "$logs/$run.time"
    ratio=$(python3 -c "print(f'{$wall / $serial_wall:.2f}')")
    echo "| $run | \`${commands[$run]}\` | $wall | $ratio | $user | $(tail -1 "$logs/$run.log" | tr -d '=' | xargs) |"
  done
} > "$out"
cat "$out"
