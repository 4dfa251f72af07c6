#!/bin/bash
# The open questions of `--seeds` on a GPU, one device call, run from the repository root through
# the `device` tool:
#
#     bash bench/investigations/stacked_gpu_call.sh        (with $OUT set; carry experiments/out/data)
#
# It asks four things, one card throughout, each step under a hard timeout so that a slow step
# leaves the rest their time, every file written as it is measured (at most 550 s):
#
# 0. What the token form's boxes and W^O's 1,200 columns bought on a GPU: bench/investigations/token_mixer.py, one
#    paper-size mixer, batch 256, alone and 6 seeds stacked (on this CPU 2.2-2.6 times faster).
# 1. Where a step's time goes: bench/investigations/stacked_kernels.py on CUDA, phase 2, a plain run against 1
#    and 6 seeds stacked. It gives the host's ms per step against the GPU's, the device kernels per
#    step, the megabytes the graph moves, and inductor's count of graphs run without CUDA graphs. A stack of one was 1.45 times a
#    plain step on an H200, with the plain run's graph kernels; this says whether the host or the
#    GPU sets that pace.
# 2. A stack's evaluation on CUDA: every seed in one batched forward against each seed's own
#    evaluation (bench/investigations/stacked_eval.py; train/stacked.py's BATCHED_EVALUATION rests on it).
# 3. --seeds' images/s on this code: bench/stacked_seeds.py, phase 2 at 1, 3 and 6 seeds stacked
#    and a plain run; phase 1 at 1 and 6 and a plain run. Compiled, batch 256 per seed, bf16.
R=$(pwd)
export PYTHONPATH=$R PYTHONUNBUFFERED=1
S=$(date +%s)
el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
git log -1 --format=%H 2>/dev/null | tee -a "$OUT/env.txt"
python -c "import torch, timm; print(torch.__version__, timm.__version__)" | tee -a "$OUT/env.txt"
D=$R/experiments/out/data
timeout 40 python bench/investigations/token_mixer.py --device cuda --batch 256 --seeds 6 2>&1 | grep -v Warning | tee "$OUT/mixer.txt"
echo "mixer done at $(el) s"
(cd bench/investigations && timeout 170 python stacked_kernels.py --device cuda --batch 256 --phases phase2 \
    --stacks 0 1 6 --data-dir "$D" 2>&1 | grep -v Warning | tee "$OUT/kernels.txt")
echo "kernels done at $(el) s"
(cd bench/investigations && timeout $(( 240 - $(el) )) python stacked_eval.py --device cuda --seeds 2 6 --val 10000 \
    --data-dir "$D" 2>&1 | grep -v Warning | tee "$OUT/eval.txt")
echo "eval done at $(el) s"
B="python bench/stacked_seeds.py --device cuda --compile --data-dir $D"
timeout $(( 420 - $(el) )) $B --phases phase2 --stacks 1 6 3 --separate 1 --out "$OUT/p2.json"
echo "p2 done at $(el) s"
timeout $(( 550 - $(el) )) $B --phases phase1 --stacks 1 6 --separate 1 --out "$OUT/p1.json"
echo "p1 done at $(el) s"
echo "total $(el) s"
