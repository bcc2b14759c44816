"""sources: every source of a rollout configuration alone, then combined, each on held-out probes against
the trainer's current policy (mismatch.measure_config). A stale engine serves the weights of k real OPD
steps ago (admit.stale_versions: the study's training settings, seed 0, from the untrained student).

    python -m study sources --pair smollm2 --weights fp8 --kv-cache fp8 --staleness 2 --noise 0.01
"""

from admit import stale_versions
from config import DEFAULT_PROBES, MEASURE_PROBES
from lab.calibrate import train_settings
from lab.rollout_args import rollout_config_from_args
from mismatch import measure_sources, print_results
from models import format_prompt, held_out, load_pair


def run_sources(args, device: str) -> None:
    cfg = rollout_config_from_args(args, pair=args.pair)
    pair = load_pair(args.pair, device=device)
    n = args.probes or MEASURE_PROBES.get(args.pair, DEFAULT_PROBES)
    probes = [format_prompt(pair.tokenizer, p.text) for p in held_out(pair, n, "--probes")]
    settings = train_settings(args.pair)
    versions = stale_versions(pair, cfg.staleness, settings, device=device)[0] if cfg.staleness else None
    results = measure_sources(pair, cfg, probes, versions=versions, progress=not args.json)
    print_results(results, args.pair, device, as_json=args.json)
