# Calls 18 and 19 (issue 15): the lattice grid with runs beyond it (as call 17, benchmarks/gpu_lr_sweep_cli9.sh) from
# the other starts, seed-matched with calls 9-16. Call 18: the GPT from 0.1x at seeds 12-27 and from 1x at 12-17;
# call 19 (PART=2): the GPT from 1x at 18-27 and Fashion-MNIST from 1x at 12-14.
# Usage: bash benchmarks/gpu_lr_sweep_cli10.sh; PART=2 bash benchmarks/gpu_lr_sweep_cli10.sh (carry data/fashion)
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
run() {  # task, starts, seeds, name
  python benchmarks/lr_sweep_cli.py --tasks $1 --starts $2 --seeds $3 --then restart --deadline 520 --runs /tmp/lsc_$4 --out $OUT/lr_sweep_cli_lattice_$4.json > $OUT/$4.log 2>&1 &
}
if [ "${PART:-1}" = 1 ]; then
  run bytes 0.1 12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27 bytes_x0.1_s12-27
  run bytes 1 12,13,14,15,16,17 bytes_x1_s12-17
else
  run bytes 1 18,19,20,21,22,23,24,25,26,27 bytes_x1_s18-27
  run fashion 1 12,13,14 fashion_x1_s12-14
fi
wait
tail -n 40 $OUT/*.log
