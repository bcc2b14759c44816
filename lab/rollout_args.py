"""The rollout engine's command-line flags, shared by train.py, mismatch.py, admit.py and the study: each
flag's default is read from rollout.RolloutConfig, and the parsed flags make one back."""

from cli import fraction, length_int, noise_sigma, nonneg_int
from cli import temperature as temperature_value
from rollout import KV_CACHES, KV_SCALES, WEIGHTS, RolloutConfig


def add_rollout_args(g, sampling: bool = True) -> None:
    """The rollout engine flags (sampling=False: the policies at temperature 1, for measurement)."""
    d = RolloutConfig()
    if sampling:
        g.add_argument(
            "--temperature",
            type=temperature_value,
            default=d.temperature,
            help="sampling temperature; 0 = greedy (default: %(default)s, the policy itself)",
        )
        g.add_argument(
            "--top-p",
            type=fraction,
            default=d.top_p,
            help="nucleus mass; 1 = no truncation (default: %(default)s)",
        )
    g.add_argument("--max-new-tokens", type=length_int, help="response length limit (default: the pair's)")
    g.add_argument(
        "--weights",
        default=d.weights,
        choices=WEIGHTS,
        help="engine weights: fp8 = weight-only; fp8-dyn = W8A8, CUDA sm>=8.9; fp8-emu = W8A8 emulated "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--fp8-skip",
        default=",".join(d.fp8_skip),
        help="comma-separated module-name patterns kept in high precision under fp8 weights "
        "('' = quantize every Linear; default: %(default)s)",
    )
    g.add_argument(
        "--kv-cache",
        default=d.kv_cache,
        choices=KV_CACHES,
        help="KV cache: model = engine dtype; fp8 = e4m3 with per-head scales (default: %(default)s)",
    )
    g.add_argument(
        "--kv-scales",
        default=d.kv_scales,
        choices=KV_SCALES,
        help="fp8 KV scales: calibrated = amax/448 on probe prompts; unit = 1.0 (default: %(default)s)",
    )
    g.add_argument(
        "--staleness",
        type=nonneg_int,
        default=d.staleness,
        help="optimizer steps the engine lags behind the trainer; 0 = synchronous (default: %(default)s)",
    )
    g.add_argument(
        "--noise",
        type=noise_sigma,
        default=d.noise,
        help="relative std of Gaussian noise on the engine's weights; 0 = none (default: %(default)s)",
    )


def rollout_config_from_args(args, pair: str) -> RolloutConfig:
    """A RolloutConfig from the add_rollout_args flags (temperature 1 and top-p 1 where they are absent); the
    response length is --max-new-tokens when given, else the pair's (config.MAX_NEW_TOKENS)."""
    d = RolloutConfig()
    return RolloutConfig.for_pair(
        pair,
        temperature=getattr(args, "temperature", d.temperature),
        top_p=getattr(args, "top_p", d.top_p),
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        weights=args.weights,
        fp8_skip=tuple(p for p in args.fp8_skip.split(",") if p),
        kv_cache=args.kv_cache,
        kv_scales=args.kv_scales,
        staleness=args.staleness,
        noise=args.noise,
    )
