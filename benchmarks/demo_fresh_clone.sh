#!/usr/bin/env bash
# `make demo` as a newcomer runs it: a fresh `git clone` of this checkout's HEAD into CLONE (default
# /tmp/featcal-demo-clone), then `/usr/bin/time -v make demo` there (the venv install and the first demo run), and
# the wall time, peak RSS and the demo's table written to benchmarks/results/demo_fresh_clone.md. When CLONE already
# holds a finished measurement (time.txt, rc.txt), only the results file is written from it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
clone=${1:-/tmp/featcal-demo-clone}
out="$repo/benchmarks/results/demo_fresh_clone.md"
if [[ ! -f "$clone/rc.txt" ]]; then
  rm -rf "$clone"
  git clone -q "$repo" "$clone"
  cd "$clone"
  date -u > started.txt
  set +e
  /usr/bin/time -v make demo > demo.log 2> time.txt
  echo $? > rc.txt
  set -e
  date -u > ended.txt
fi
cd "$clone"
field() { grep -m1 "$1" time.txt | sed 's/.*: //'; }
wall=$(field "Elapsed (wall clock) time")
rss_kib=$(field "Maximum resident set size")
{
  echo "# \`make demo\` in a fresh clone: wall time and peak memory"
  echo
  echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) logical CPUs" \
       "($(grep -o -w -m1 -e avx512_bf16 /proc/cpuinfo | head -1) $(grep -o -w -m1 -e amx_bf16 /proc/cpuinfo | head -1));" \
       "shared with other jobs (load average at the end: $(cut -d' ' -f1 /proc/loadavg))."
  echo "Clone of commit $(git rev-parse --short HEAD); started $(cat started.txt), ended $(cat ended.txt);" \
       "exit status $(cat rc.txt). Written by \`benchmarks/demo_fresh_clone.sh\`."
  echo
  echo "| command | wall (h:mm:ss or m:ss) | peak RSS (GiB) |"
  echo "|---|---:|---:|"
  echo "| \`make demo\` (creates .venv, installs, fine-tunes 3 experts, runs TA + FeatCal) | $wall |" \
       "$(awk -v k="$rss_kib" 'BEGIN { printf "%.2f", k / 1048576 }') |"
  echo
  echo "Peak RSS is GNU time's maximum resident set size: the largest single process of the command's tree."
  echo
  echo "Accuracy table printed by the demo:"
  echo
  grep '^|' demo.log || echo "(no table: see $clone/demo.log)"
} > "$out"
cat "$out"
