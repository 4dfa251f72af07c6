#!/bin/bash
# issue 67, the one device call: bench/stacked_seeds.py at S = 1, 6, 3 for phase 2 then phase 1,
# compiled, batch 256 per seed; then 3 separate processes of each phase and the device kernels per
# step (bench/stacked_kernels.py), as far as the call's time goes. Each step has a hard timeout so
# a slow one leaves the rest their time; every file is written as it is measured.
R=$(pwd); export PYTHONPATH=$R PYTHONUNBUFFERED=1
S=$(date +%s)
el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/env.txt
python -c "import torch, timm; print(torch.__version__, timm.__version__)" | tee -a $OUT/env.txt
D=$R/experiments/out/data
B="python bench/stacked_seeds.py --device cuda --compile --data-dir $D"
timeout 220 $B --phases phase2 --stacks 1 6 3 --separate --out $OUT/stacked_p2.json; echo "p2 stacks done at $(el) s"
timeout $(( 420 - $(el) )) $B --phases phase1 --stacks 1 6 3 --separate --out $OUT/stacked_p1.json; echo "p1 stacks done at $(el) s"
timeout $(( 470 - $(el) )) $B --phases phase2 --stacks --separate 3 --out $OUT/separate_p2.json; echo "p2 separate done at $(el) s"
cd bench
timeout $(( 535 - $(el) )) python stacked_kernels.py --device cuda --phases phase2 --stacks 1 6 --data-dir $D 2>&1 | grep -v Warning | tee $OUT/kernels.txt; echo "kernels done at $(el) s"
cd $R
timeout $(( 555 - $(el) )) $B --phases phase1 --stacks --separate 3 --out $OUT/separate_p1.json; echo "p1 separate done at $(el) s"
echo "total $(el) s"
