"""OPD learns: a short run on the tiny pair lowers the held-out reverse KL by a stated margin.

The margin is half the drop measured on a 2-core CPU (20 steps at lr 3e-4 after 5 warm-up steps, 256
held-out prompts: 3.026 -> 2.919), so the test fails when a change stops the student from learning, and
passes wherever it learns. The sampled-token estimator moved only 3.026 -> 3.013 in the same 20 steps:
too little to test against the evaluation's noise, so it is not tested here. Early tiny training is bumpy at the demo's peak
learning rate (1.5e-3): 20 steps of it raise the held-out reverse KL before the cosine schedule brings it
down, so the test uses the lower rate.
"""

import pytest

from lab.train_args import pair_config
from train import run

pytestmark = pytest.mark.slow  # 20 training steps

STEPS = 20
MARGIN = 0.05  # nats/token


def test_twenty_opd_steps_lower_the_held_out_reverse_kl(tmp_path, loss="analytic"):
    cfg = pair_config(
        "tiny",
        steps=STEPS,
        lr=3e-4,
        warmup=5,
        schedule="constant",
        eval_every=0,
        eval_prompts=256,
        ckpt_every=0,
        loss=loss,
        name=f"learns-{loss}",
        out_dir=str(tmp_path),
        device="cpu",
    )
    records = run(cfg, quiet=True)
    evals = [r for r in records if "eval_rkl" in r]
    start, end = evals[0]["eval_rkl"], evals[-1]["eval_rkl"]
    assert [r["step"] for r in evals] == [0, STEPS]
    print(f"{loss}: held-out reverse KL {start:.3f} -> {end:.3f}")
    assert start - end >= MARGIN, f"{loss}: held-out reverse KL {start:.3f} -> {end:.3f}, drop < {MARGIN}"
