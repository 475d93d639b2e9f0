# Call 16: still more seeds for the restart recipe on the GPT (issue 15; fixed before the call, whatever it showed),
# seeds 23-27 from every start and the references at seeds 21-23. Usage: bash benchmarks/gpu_lr_sweep_cli8.sh
SEEDS=23,24,25,26,27 REF_SEEDS=21,22,23 bash "$(dirname "$0")/gpu_lr_sweep_cli5.sh"
