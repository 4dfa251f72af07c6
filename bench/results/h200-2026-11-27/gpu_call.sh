#!/bin/bash
# issue 67, the second device call: after the two fixes (no graph break in the stacked step; no CPU
# tensor in it), phase 2 one seed alone (a plain run), 1 and 6 seeds stacked; phase 1 6 seeds and
# one alone; then phase 1 1 seed stacked as far as the time goes. TORCH_LOGS=perf_hints (shown
# under CMHSA_DEBUG) prints inductor's reasons for skipping CUDA graphs; the bench keeps them.
R=$(pwd); export PYTHONPATH=$R PYTHONUNBUFFERED=1 TORCH_LOGS=perf_hints CMHSA_DEBUG=1
S=$(date +%s)
el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/env.txt
D=$R/experiments/out/data
B="python bench/stacked_seeds.py --device cuda --compile --data-dir $D"
timeout 150 $B --phases phase2 --stacks 1 6 --separate 1 --out $OUT/p2.json; echo "p2 done at $(el) s"
timeout $(( 250 - $(el) )) $B --phases phase1 --stacks 6 --separate 1 --out $OUT/p1.json; echo "p1 done at $(el) s"
timeout $(( 296 - $(el) )) $B --phases phase1 --stacks 1 --separate --out $OUT/p1_s1.json; echo "p1 s1 done at $(el) s"
echo "total $(el) s"
