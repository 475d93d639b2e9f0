# Call 17 (issue 15): hdet train --lr-sweep 0.2 (restart) with the sweep's grid on a lattice and its runs beyond the
# grid (hdet.lr_sweep's extend), from the starts whose grids used to sit off-centre: the GPT from 10x at the seeds of
# calls 9-16 (12-27: seed-matched with the grid before), Fashion-MNIST from 0.1x and 10x at call 9's seeds (12-14).
# Usage: bash benchmarks/gpu_lr_sweep_cli9.sh (carry data/fashion)
set -x
export PYTHONPATH=$PWD/src
S=12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks bytes --starts ${STARTS:-10} --seeds $S --then restart --deadline 520 --runs /tmp/lsc --out $OUT/lr_sweep_cli_lattice_bytes_x${STARTS:-10}_s12-27.json > $OUT/sweep.log 2>&1 &
python benchmarks/lr_sweep_cli.py --tasks fashion --starts ${FASHION_STARTS:-0.1,10} --seeds 12,13,14 --then restart --deadline 520 --runs /tmp/lsc_f --out $OUT/lr_sweep_cli_lattice_fashion_s12-14.json > $OUT/fashion.log 2>&1 &
wait
tail -n 40 $OUT/*.log
