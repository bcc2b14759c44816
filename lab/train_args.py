"""What one OPD run is told: its settings (TrainConfig, a pair's defaults by pair_config, the settings a
--resume may change) and train.py's command line, which fills them in for a new run or a resumed one.
train.py runs them; lab.calibrate, the study and the tools build them with pair_config."""

import time
from dataclasses import asdict, dataclass, field, fields, replace

from budget import CALIBRATABLE
from cli import (
    MAX_BATCH,
    BadInput,
    Parser,
    batch_int,
    cap_float,
    nonneg_float,
    nonneg_int,
    path_text,
    positive_int,
    recheck_flags,
    seed_int,
)
from cli import learning_rate as lr_value
from config import CHAT_PAIR, CHAT_PAIR_HELP, DEVICES, PAIR_TRAIN, PAIRS, SCHEDULES
from lab.rollout_args import add_rollout_args, rollout_config_from_args
from lab.runfiles import check_target, load_config, resume_changes
from loss import ESTIMATORS
from rollout import RolloutConfig

# ---------------------------------------------------------------------------------------------------
# The settings of one run


@dataclass
class TrainConfig:
    """One OPD run. Saved in full to runs/<name>/config.json. The field defaults are what every pair shares;
    config.PAIR_TRAIN replaces some of them per pair (pair_config)."""

    pair: str = CHAT_PAIR  # tiny | smollm2 | gemma3 | custom (= --teacher/--student)
    teacher: str | None = None  # HF id or local path; replaces --pair
    student: str | None = None
    student_layers: int | None = None  # smollm2/gemma3: decoder layers the student keeps; None = the pair's
    prompts: str | None = None  # JSONL file of {"prompt": ...}; replaces the pair's prompts
    steps: int = 20  # optimizer steps
    batch_size: int = 4  # training prompts per step
    samples_per_prompt: int = 2  # responses sampled per prompt
    lr: float = 5e-5  # AdamW peak learning rate
    warmup: int = 0  # steps of linear learning-rate warm-up, then `schedule`
    schedule: str = "constant"  # after warm-up: constant | cosine (down to 10% of lr at the last step)
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    loss: str = "analytic"  # analytic (full-vocabulary KL) | sampled (sampled-token gradient) | grpo (RL)
    tis_cap: float = field(default=0.0, metadata={"inf": True})  # C in min(π_train/π_engine, C); 0 off; inf
    center_advantages: bool = False  # sampled/sampler: subtract the batch's mean advantage (loss.py)
    async_rollout: bool = False  # one-step-off: sample step s+1's batch in a background thread during step s
    kl_chunk: int = 256  # response tokens per chunk when computing full-vocabulary KL (bounds memory)
    eval_every: int = 5  # evaluate every N steps (and after the last); 0 = only at the start and end
    eval_prompts: int = 16  # held-out prompts per evaluation
    ckpt_every: int = 1  # checkpoint every N steps; 0 = by time only (ckpt_minutes); always after the last
    ckpt_minutes: float = 0.0  # also checkpoint when this many minutes passed since the last one; 0 = off
    seed: int = 0  # seeds prompt order and sampling (per step, so a resumed run repeats them exactly)
    device: str = "auto"  # auto | cpu | cuda
    name: str = ""  # run folder name under out_dir; "" = <pair>-<timestamp>
    out_dir: str = "runs"
    budget: str | None = None  # budget.json the running mismatch is compared with (watch_budget); None off
    over_budget: str = "warn"  # above the budget: warn | stop (a checkpoint at that step, exit 6)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self):  # combinations no single flag can refuse (each flag's range: its converter)
        rows, k = self.batch_size * self.samples_per_prompt, self.samples_per_prompt
        if self.loss == "grpo" and k < 2:
            raise BadInput(
                f"--loss grpo --samples-per-prompt {k}: the advantage (a reward minus its group's "
                "mean) is 0 in a group of one; use 2 or more"
            )
        if rows > MAX_BATCH:
            raise BadInput(f"--batch-size x --samples-per-prompt = {rows} rows; at most {MAX_BATCH}")
        if self.tis_cap > 0 and self.loss == "analytic":
            raise BadInput(
                f"--tis-cap {self.tis_cap:g}: applies to --loss sampled, sampler or grpo (the "
                "analytic loss sums over the vocabulary: the sampled token needs no correction)"
            )
        if self.center_advantages and self.loss not in ("sampled", "sampler"):
            raise BadInput(
                f"--center-advantages with --loss {self.loss}: applies to --loss sampled or sampler (the "
                "analytic loss has no advantage; grpo's advantages are already centred on their group)"
            )
        if self.over_budget == "stop" and self.budget is None:
            raise BadInput("--over-budget stop: needs --budget BUDGET.json, the budget to stop at")
        if self.budget is not None and self.loss not in CALIBRATABLE:
            raise BadInput(
                f"--budget with --loss {self.loss}: a budget holds for one OPD loss "
                f"({', '.join(CALIBRATABLE)}; python -m lab.calibrate --loss)"
            )


def pair_config(pair: str, **overrides) -> TrainConfig:
    """A TrainConfig with the pair's default settings (config.PAIR_TRAIN, its response length), then
    `overrides`."""
    rollout = RolloutConfig.for_pair(pair)
    return TrainConfig(pair=pair, **{**PAIR_TRAIN[pair], "rollout": rollout, **overrides})


# Settings a --resume may change: none of them changes what the run computes (steps: extend only).
# The budget and what to do past it only watch the run.
SAFE_ON_RESUME = (
    "steps",
    "ckpt_every",
    "ckpt_minutes",
    "kl_chunk",
    "device",
    "name",
    "out_dir",
    "budget",
    "over_budget",
)

# ---------------------------------------------------------------------------------------------------
# Command line


def per_pair(key: str) -> str:
    """'default: 600 tiny, 12 smollm2, ...' for a help string, read from config.PAIR_TRAIN."""
    values = {p: PAIR_TRAIN[p].get(key, getattr(TrainConfig, key, None)) for p in PAIR_TRAIN}
    shown = [f"{v:g} {p}" if isinstance(v, float) else f"{v} {p}" for p, v in values.items()]
    return "default: " + ", ".join(shown)


# (flag, type, help) of the training flags whose defaults differ per pair; their help reads PAIR_TRAIN.
PER_PAIR_FLAGS = [
    ("--steps", positive_int, "optimizer steps"),
    ("--batch-size", batch_int, "training prompts per step"),
    ("--samples-per-prompt", batch_int, "responses sampled per prompt"),
    ("--lr", lr_value, "AdamW peak learning rate"),
    ("--warmup", nonneg_int, "steps of linear learning-rate warm-up"),
    ("--eval-every", nonneg_int, "evaluate every N steps; 0 = only at the start and end"),
    ("--eval-prompts", batch_int, "held-out prompts per evaluation"),
    ("--ckpt-every", nonneg_int, "checkpoint every N steps; 0 = by time only"),
    ("--ckpt-minutes", nonneg_float, "also checkpoint every M minutes; 0 = off"),
]
# (flag, type, help) of the flags with one default for every pair, read from TrainConfig.
COMMON_FLAGS = [
    ("--weight-decay", nonneg_float, "AdamW weight decay"),
    ("--grad-clip", nonneg_float, "max gradient norm; 0 = no clipping"),
    ("--tis-cap", cap_float, "non-analytic losses: weight min(π_train/π_engine, C); 0 off, inf full IS"),
    ("--kl-chunk", positive_int, "response tokens per full-vocabulary chunk (bounds memory)"),
    ("--seed", seed_int, "seed for prompt order, sampling and weight noise"),
    ("--out-dir", path_text, "parent folder of run folders"),
]


# the flags that load any Hugging Face pair and its prompts, as train.py and lab.calibrate read them
PAIR_FILE_FLAGS = [
    ("--teacher", "HF id or local folder of the teacher (with --student; replaces --pair)"),
    ("--student", "HF id or local folder of the student; shares the teacher's tokenizer"),
    ("--prompts", 'JSONL of {"prompt": ..., "answer": optional}; every 10th is held out'),
]


def add_pair_files(p) -> None:
    """--teacher, --student and --prompts (PAIR_FILE_FLAGS): names of files and folders, so text."""
    for flag, text in PAIR_FILE_FLAGS:
        p.add_argument(flag, type=path_text, help=text)


def build_parser() -> Parser:
    d = TrainConfig()
    p = Parser(
        description="On-policy distillation: the student lowers reverse KL to the teacher on its own samples."
    )
    p.add_argument("--pair", default=d.pair, choices=PAIRS, help=CHAT_PAIR_HELP)
    add_pair_files(p)
    p.add_argument("--student-layers", type=positive_int, help="smollm2/gemma3: the student's decoder layers")
    for flag, kind, text in PER_PAIR_FLAGS:
        p.add_argument(flag, type=kind, help=f"{text} ({per_pair(flag[2:].replace('-', '_'))})")
    for flag, kind, text in COMMON_FLAGS:
        default = getattr(d, flag[2:].replace("-", "_"))
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    p.add_argument("--schedule", choices=SCHEDULES, help=f"lr after warm-up ({per_pair('schedule')})")
    p.add_argument(
        "--loss",
        default=d.loss,
        choices=ESTIMATORS,
        help="analytic: full-vocabulary reverse "
        "KL; sampled / sampler: sampled-token gradient, trainer's / engine's log-prob in the "
        "advantage (tinker: sampler --tis-cap inf); grpo: the RL baseline (default: %(default)s)",
    )
    p.add_argument(
        "--center-advantages",
        action="store_true",
        default=None,
        help="sampled / sampler: subtract the batch's mean advantage from every token's (a baseline)",
    )
    p.add_argument(
        "--async",
        dest="async_rollout",
        action="store_true",
        help="one-step-off: sample the next batch in a background thread during this step",
    )
    p.add_argument("--device", default=d.device, choices=DEVICES, help="(default: %(default)s: CUDA if any)")
    p.add_argument(
        "--name",
        type=path_text,
        default=d.name,
        help="run folder under --out-dir, one folder name (default: <pair>-<timestamp>)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue --out-dir/--name from its last checkpoint "
        f"with its saved config (may change: {', '.join(SAFE_ON_RESUME[:4])}; --steps only up)",
    )
    add_rollout_args(p.add_argument_group("rollout engine"))
    add_budget_args(p.add_argument_group("the mismatch budget, checked at every step"))
    return p


OVER_BUDGET = ("warn", "stop")


def add_budget_args(g) -> None:
    g.add_argument(
        "--budget",
        type=path_text,
        help="budget.json of this pair and loss (python -m lab.calibrate): a line when the running mismatch "
        "is above its interval; over_budget in metrics.jsonl",
    )
    g.add_argument(
        "--over-budget",
        choices=OVER_BUDGET,
        help="above the budget: warn, or stop with a checkpoint at that step, exit 6 (default: warn)",
    )


def config_from_args(args) -> TrainConfig:
    """The pair's TrainConfig (config.PAIR_TRAIN), with every flag the user gave on top."""
    pair = "custom" if args.teacher else args.pair
    cfg = pair_config(pair)
    given = {
        f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None
    }
    given.update(pair=pair, name=args.name or f"{pair}-{time.strftime('%Y%m%d-%H%M%S')}")
    given.pop("rollout", None)
    cfg = replace(cfg, **given)
    cfg.rollout = rollout_config_from_args(args, pair=pair)
    return cfg


def config_for(args, given: set[str]) -> TrainConfig:
    """A new run's config; or, with --resume, the saved one (in the folder given, whatever it says inside)
    with the flags given applied if they are SAFE_ON_RESUME (with a note), refused by name otherwise."""
    if not args.resume:
        cfg = config_from_args(args)
        check_target(cfg.out_dir, cfg.name, resume=False)  # before loading anything
        return cfg
    if not args.name:
        raise BadInput("--resume needs --name NAME of the run to continue")
    run_dir = check_target(args.out_dir, args.name, resume=True)
    cfg = replace(load_config(run_dir, TrainConfig), out_dir=args.out_dir, name=args.name)
    choices = {
        "pair": (*PAIRS, "custom"),
        "loss": ESTIMATORS,
        "schedule": SCHEDULES,
        "over_budget": OVER_BUDGET,
    }
    recheck_flags(cfg, PER_PAIR_FLAGS + COMMON_FLAGS, choices=choices, where=f"{run_dir}/config.json")
    new = resume_changes(
        asdict(cfg),
        asdict(config_from_args(args)),
        given=given,
        safe=SAFE_ON_RESUME,
        source=run_dir / "config.json",
    )
    return replace(cfg, **new)
