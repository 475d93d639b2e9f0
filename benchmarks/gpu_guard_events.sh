# Call 20 (issue 15): the GPT runs of calls 17-18 in which the stability guard acted, again at their swept peak LR,
# with and without the guard (benchmarks/guard_events.py). Usage: bash benchmarks/gpu_guard_events.sh
set -x
export PYTHONPATH=$PWD/src
D=benchmarks/results/evidence/sweep_then_train
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/guard_events.py --task bytes --from $D/call17/lr_sweep_cli_lattice_bytes_x10_s12-27.json $D/call18/lr_sweep_cli_lattice_bytes_x0.1_s12-27.json $D/call18/lr_sweep_cli_lattice_bytes_x1_s12-17.json --runs /tmp/ge --deadline 470 --out $OUT/guard_events_bytes.json
