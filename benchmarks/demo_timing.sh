#!/usr/bin/env bash
# Times the README's main command on a fresh checkout: `make install`, then `make demo` twice (first run and
# rerun from cache). The issue's promise: ≤ 15 min the first time and ≤ 1 min the second, on a quiet 2-core
# machine. Run it on an otherwise idle machine; it deletes .venv and demo/ first.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/demo_timing.md
logs=$(mktemp -d)
rm -rf .venv demo
for step in install demo-first demo-rerun; do
  /usr/bin/time -f "%e %U %M" -o "$logs/$step.time" make "${step%%-*}" > "$logs/$step.log" 2>&1
done
{
  echo "# \`make demo\` on a fresh checkout"
  echo
  echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $(date -u +%Y-%m-%d)."
  echo
  echo "| step | wall (s) | user CPU (s) | peak RSS (MiB) |"
  echo "|---|---:|---:|---:|"
  for step in install demo-first demo-rerun; do
    read -r wall user rss < "$logs/$step.time"
    echo "| $step | $wall | $user | $((rss / 1024)) |"
  done
  echo
  echo "Accuracy table printed by the first run:"
  echo
  grep '^|' "$logs/demo-first.log"
} > "$out"
cat "$out"
