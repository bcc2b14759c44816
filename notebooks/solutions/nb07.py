"""Answers to notebook 07: k3 from a dump's two columns, one schema line, the effective sample size."""

import json
import math


def my_k3(engine_logprobs, train_logprobs):
    """Mean over every token of ρ − 1 − log ρ, ρ = exp(train − engine)."""
    terms = []
    for eng, trn in zip(engine_logprobs, train_logprobs):
        for le, lt in zip(eng, trn):
            rho = math.exp(lt - le)
            terms.append(rho - 1 - math.log(rho))
    return sum(terms) / len(terms)


def my_dump_line(engine_logprobs, train_logprobs, seq_id):
    """One JSONL line of the dump schema."""
    line = {"id": seq_id, "engine_logprobs": list(engine_logprobs), "train_logprobs": list(train_logprobs)}
    return json.dumps(line)


def my_ess(engine_logprobs, train_logprobs):
    """(Σρ)² / (n Σρ²) over every token."""
    rho = [math.exp(lt - le) for eng, trn in zip(engine_logprobs, train_logprobs) for le, lt in zip(eng, trn)]
    return sum(rho) ** 2 / (len(rho) * sum(r * r for r in rho))
