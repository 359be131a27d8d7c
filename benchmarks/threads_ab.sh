#!/usr/bin/env bash
# A/B of the CPU thread count on the quick-start job, side by side in one run: 10 iterations of `diffgrpo train`
# with no environment variables (auto: one thread for the built-in model) against model.cpu_threads=2 and
# torch's default, alternating, R rounds. Usage: bash benchmarks/threads_ab.sh [ROUNDS] [OUT_DIR]
set -euo pipefail
rounds="${1:-2}"
out="${2:-benchmarks/results/threads}"
mkdir -p "$out"
unset OMP_NUM_THREADS MKL_NUM_THREADS
tmp="$(mktemp -d)"
diffgrpo pretrain log.progress=false > /dev/null  # the cached base model, so every timed run does the same work
echo "# $(date -u +%FT%TZ) $(nproc) cores, load before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$out/ab.tsv"
printf 'round\tvariant\tthreads\tseconds\n' | tee -a "$out/ab.tsv"
for r in $(seq 1 "$rounds"); do
  for v in auto 2; do
    extra=(); [ "$v" = auto ] || extra=("model.cpu_threads=$v")
    t0=$(date +%s.%N)
    diffgrpo train train.num_iterations=10 log.progress=false log.save_images=false \
        "log.output_dir=$tmp/r$r-$v" "${extra[@]}" > "$tmp/r$r-$v.log"
    t1=$(date +%s.%N)
    printf '%s\t%s\t%s\t%.1f\n' "$r" "$v" "$( [ "$v" = auto ] && echo 1 || echo "$v")" "$(echo "$t1 - $t0" | bc)" \
        | tee -a "$out/ab.tsv"
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/ab.tsv"
rm -rf "$tmp"
