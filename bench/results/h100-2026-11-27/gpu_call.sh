#!/bin/bash
# issue 57, the one device call: a CUDA smoke of --seeds, the stacked-seeds throughput bench
# (phase 2), then the plateau arms that answer the phase-2 dip, as far as the call's time goes
R=$(pwd); export PYTHONPATH=$R
S=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, timm; print(torch.__version__, timm.__version__)"
D=$R/experiments/out/data
T="--data synthetic --img-size 16 --patch-size 4 --depth 2 --kernel-size 3 --batch-size 32 --workers 0 --epochs 2 --warmup-epochs 0 --device cuda --drop-path 0.1 --amp none"
timeout 45 python -m convit_convert train phase1 $T --seeds 0,1 -o /tmp/smoke/stack > $OUT/smoke.txt 2>&1; echo "smoke stacked rc $?"
timeout 45 python -m convit_convert train phase1 $T --seed 1 -o /tmp/smoke/sep1 >> $OUT/smoke.txt 2>&1; echo "smoke separate rc $?"
paste -d'|' /tmp/smoke/sep1/metrics.csv /tmp/smoke/stack/seed1/metrics.csv | cut -c1-220
echo "smoke done at $(( $(date +%s) - S )) s"
timeout 200 python bench/stacked_seeds.py --device cuda --compile --data-dir $D --phases phase2 --stacks 1 3 --separate 3 --out $OUT/bench_p2.json
echo "bench done at $(( $(date +%s) - S )) s"
LEFT=$(( 560 - ($(date +%s) - S) ))
cd experiments
timeout $(( LEFT + 20 )) python plateau_stacked.py --epochs 200 --train-samples 60000 --val-samples 10000 --eval-every 5 \
  --batch-size 256 --device cuda --compile --figure2 --data-dir $D --only half-p1 gated gated-nowarm hard p1 \
  --parallel 5 --time-budget $LEFT --out /tmp/plateau > $OUT/plateau_log.txt 2>&1; echo "plateau rc $?"
python plateau_stacked.py --report --epochs 200 --figure2 --out /tmp/plateau > $OUT/plateau_table.md 2>&1
tail -5 $OUT/plateau_log.txt; cat $OUT/plateau_table.md
cd /tmp/plateau && tar czf $OUT/plateau_runs.tgz $(find . -name metrics.csv -o -name config.json -o -name log.txt -o -name results.json)
echo "total $(( $(date +%s) - S )) s"
