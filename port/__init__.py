"""Other systems' exports: their on-disk layouts read into one dump format, estimated, judged and audited.

dumps     the project's own log-dump schema (JSONL or .pt), the format every reader produces
native    readers for prime-rl, slime, verl, TRL and vLLM exports, each in that system's own layout
estimate  the one scale from a dump's sampled (and top-k) log-probs, its interval and its flags
audit     the audit page of an export: per-position and per-token estimates, a figure and a report
judge     an export judged against a budget, per step (its worst step, its blind spot); `check --dump`, `audit`
"""
