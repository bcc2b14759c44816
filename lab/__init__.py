"""The harness that makes runs safe and budgets reproducible, around the method in the top-level core.

atomic        atomic writes: a full disk is one line and nothing half-written
hf_pairs      the packaged Hugging Face pairs: GGUF teachers converted once, layer-dropped students
budget_schema the schema of a budget.json, checked once for every reader
runfiles      the run folder: strict metrics, checkpoints, the lock, the resume diff
kv_capacity   the KV-capacity table (`python -m lab.kv_capacity --memory-gb 80`)
rollout_args  the engine's command-line flags, shared by every command that samples
sample        a few samples printed with their log-probs (`python -m lab.sample --pair tiny --n 4`)
train_args    one run's settings (TrainConfig, pair_config) and train.py's command line
watch         the mismatch budget watched inside a training run (train.py --budget)
calibrate     budgets from short training runs (`python -m lab.calibrate --pair tiny --out budgets/tiny`)
"""
