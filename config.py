"""Every default the commands share, defined once: the pairs table, the study's training settings, the probe
counts. Plain data (no torch, no project import), so every layer can read it.

The types stay beside the code that uses them: lab.train_args.TrainConfig and rollout.RolloutConfig hold
what one run uses, with the settings every pair shares as their field defaults; the per-pair values here
replace those (lab.train_args.pair_config, RolloutConfig.for_pair). The committed budgets and results were
measured with these values: a change here changes what a rerun measures. tests/test_config.py keeps them from
being re-stated elsewhere.
"""

import math

# ---------------------------------------------------------------------------------------------------
# The pairs

PAIRS = ("tiny", "smollm2", "gemma3")  # the embedded pairs; "custom" is any --teacher/--student pair
DEVICES = ("auto", "cpu", "cuda")

# The pair a command uses without --pair. The commands that measure (mismatch.py, rollout.py, admit.py check,
# lab.calibrate and the study's tiny experiments) default to tiny: it loads in a second, and its measurements
# and short runs are the fastest on a CPU. train.py's main job is the chat pair (the README's first command),
# so it defaults to CHAT_PAIR, as do the commands that inspect or time the chat pair (models.py info, study
# async, the benchmarks). Each --pair help says which of the two it takes, and why.
DEFAULT_PAIR = "tiny"
CHAT_PAIR = "smollm2"
DEFAULT_PAIR_HELP = (
    f"the pair (default: {DEFAULT_PAIR}, the fast one; train.py defaults to {CHAT_PAIR}, the chat pair)"
)
CHAT_PAIR_HELP = (
    f"the pair (default: {CHAT_PAIR}, the chat pair this command is for; {DEFAULT_PAIR} is the fast one)"
)

# Response length per pair (training, evaluation, probes and check). tiny's answers are short sums; the chat
# pairs answer in a few sentences.
MAX_NEW_TOKENS = {"tiny": 6, "smollm2": 48, "gemma3": 48, "custom": 48}
# Decoder layers the layer-dropped students keep by default (of their teacher's 30 / 18).
STUDENT_LAYERS = {"smollm2": 24, "gemma3": 14}

# Per-pair training settings (lab.train_args.pair_config); every other field takes TrainConfig's default. The
# checkpoint cadence keeps the time spent saving under 5% of a run: a smollm2 checkpoint (weights + AdamW
# state) is 1.36 GB.
PAIR_TRAIN = {
    "tiny": dict(
        steps=600,
        batch_size=64,
        samples_per_prompt=4,
        lr=1.5e-3,
        warmup=20,
        schedule="cosine",
        eval_every=100,
        eval_prompts=256,
        ckpt_every=100,
    ),
    "smollm2": dict(steps=12, lr=5e-5, eval_every=6, ckpt_every=0, ckpt_minutes=5.0),
    "gemma3": dict(steps=12, lr=5e-5, eval_every=4, ckpt_every=0, ckpt_minutes=5.0),
    "custom": dict(steps=20, lr=5e-5, eval_every=5, ckpt_every=0, ckpt_minutes=5.0),
}

# ---------------------------------------------------------------------------------------------------
# The study's settings

# The study's short runs (calibrate, check's stale trajectories, the study) keep the training settings the
# committed budgets and results were measured with, whatever a pair's demo defaults (PAIR_TRAIN) become;
# budget.json records them, and a validation trains at the settings its budget records. A pair without an
# entry uses its defaults. tiny: the demo's schedule (lr 1.5e-3, 20 warm-up steps, cosine) cut to 400 steps,
# where the analytic baseline learns (greedy accuracy 0.35 -> 0.75-0.77). Each loss's learning rate is its
# own, chosen by `python -m study lr` (results/lr_<pair>.json, lab.calibrate.study_recipe) once that sweep
# is complete.
STUDY_TRAIN = {
    "tiny": {"steps": 400},
    # 64 held-out prompts instead of the demo's 16: halves the evaluation's sampling noise
    "smollm2": {"eval_prompts": 64},
}
# The quality loss a budget allows: this fraction of the clean baseline's improvement in held-out reverse KL
# over step 0 (lab.calibrate --tolerance); one tolerance for every budget the study compares.
STUDY_TOLERANCE = 0.2
# The losses of the study, by label (budget.loss_label): the analytic loss and four sampled-token ones.
STUDY_LOSSES = {
    "analytic": {"loss": "analytic"},
    "sampled": {"loss": "sampled"},
    "sampled-centered": {"loss": "sampled", "center_advantages": True},
    "sampled-tis2": {"loss": "sampled", "tis_cap": 2.0},
    "sampler-is": {"loss": "sampler", "tis_cap": math.inf},  # tinker's estimator
}
# The schedule of tiny's first budgets (60 steps at a constant lr 3e-4, where OPD has only begun: greedy
# accuracy flat), pinned by study.prefix and the GPU check's short runs, and the schedule of the records
# results/*_60steps.json hold.
TINY_EARLY = {"steps": 60, "lr": 3e-4, "warmup": 10, "schedule": "constant"}

# ---------------------------------------------------------------------------------------------------
# Probe counts: held-out prompts a measurement samples (models.held_out: the pair's first n)

# A calibration measures each configuration on the first CHECK_PROBES held-out prompts (lab.calibrate
# --probes), and a check probes in doubling batches, FIRST_PROBES first (8, 16, 32, ...), until its interval
# decides or CHECK_PROBES are used (admit.py check --probes, study validate --probes): at its cap a check
# measures on the prompts the budget's points were measured on.
CHECK_PROBES = 64
FIRST_PROBES = 8
# One measurement of a configuration without --probes (mismatch.py, study sources): MEASURE_PROBES for the
# pairs it names, DEFAULT_PROBES for the others, whose probes are slower; study sensitivity, which measures
# every decoder block, takes DEFAULT_PROBES for every pair.
MEASURE_PROBES = {"tiny": 64}
DEFAULT_PROBES = 16
# fp8 KV scales are calibrated (amax/448) on the first KV_SCALE_PROMPTS training prompts, never held-out ones
# (batches.make_engine, mismatch.measure_config).
KV_SCALE_PROMPTS = 8

# ---------------------------------------------------------------------------------------------------
# Training choices

# The learning-rate schedules after warm-up (train.learning_rate; train.py --schedule).
SCHEDULES = ("constant", "cosine")
