#!/usr/bin/env bash
# The GPU suite: every gradient engine against recompute on transformers at real sizes (SD3.5-Medium, Wan 2.1
# 1.3B, FLUX.1-dev, FLUX.2 [klein] 4B at 1024 px, Wan 2.2 T2V A14B's two experts; random weights from their config
# numbers, no download), with and without LoRA and activation checkpointing, compiled or eager, plus a masked LM at
# LLaDA-8B's shape with both rollout decoders; per cell the time shares and the fraction of the bf16 peak reached.
# Tables: benchmarks/results/gpu/suite.md and suite.json (command and hardware line included).
#
#   bash benchmarks/gpu/suite.sh                 # one GPU, at most 8 minutes (hard timeout below)
#   bash benchmarks/gpu/suite.sh --size toy      # the same cells on the CPU at toy sizes (CI, < 60 s)
#   bash benchmarks/gpu/suite.sh --size small --device cpu --out benchmarks/results/memory   # CPU memory table
#
# Other flags: --models sd3,mlm,wan,flux,flux2_klein,wan22_a14b  --cells full,full+compile,lora+ckpt,...
#              --peak-tflops T  --budget SECONDS  --cell-limit SECONDS  --repeats N
# SUITE_TIMEOUT (seconds, default 480) bounds the whole run; the suite also keeps its own budget (450 s at real
# size) and writes its tables after every cell, so a killed run still leaves the cells it finished.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python}"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --kill-after=10 "${SUITE_TIMEOUT:-480}" "$PY" benchmarks/gpu/suite.py "$@"
