"""The study: the experiments behind the project's findings, each a set of short train.py runs or probe
measurements summarised into results/ (a JSON file and a plot each). One module per experiment:

    lr               each loss's clean baseline by learning rate, and the rate it trains at (study/lr.py)
    validate         the admission check against real training (study/validate.py)
    rl               OPD vs GRPO under the same rollout configurations (study/opd_vs_rl.py)
    prefix           per-token vs prefix-shift mismatch, three OPD estimators (study/prefix.py)
    async            time-to-quality, sync/async × bf16/fp8 (study/time_to_quality.py)
    sources          every mismatch source alone and combined, staleness included (study/sources.py)
    sensitivity      FP8 one decoder block at a time, and a greedy recipe (study/sensitivity.py)
    coverage         how often a dump's CI misses the exact KL, k3-only and top-k (study/coverage.py)
    report           results/SUMMARY.md from all of the above (study/report.py), with the answer
                     (study/answer.py), the budgets per loss (study/losses.py) and the staleness axis
                     per loss (study/staleness.py)

Run them as `python -m study <experiment> ...`; finished runs are reused and killed ones resume
(train.run_or_resume), so any command can be rerun. The training settings of every study run are
lab.calibrate.study_config's (config.STUDY_TRAIN, and each loss's own rate once `lr` has chosen it; validate
trains at the settings its budget records), except rl's, which pins its own (study.opd_vs_rl.RL_COMMON) so
that GRPO learns, and prefix's (study.prefix.PREFIX_TRAIN).
"""
