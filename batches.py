"""Where a training step's batch comes from: the rollout engine samples the step's prompts, synchronously or
one step ahead in a background thread (one-step-off async), and what a checkpoint needs to continue exactly.

`cfg` below is a lab.train_args.TrainConfig (batch_size, samples_per_prompt, seed, steps, async_rollout,
rollout).
Every batch depends only on (seed, step) and the engine's served weights, so a resumed run redraws exactly
the batches an uninterrupted one would.
"""

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from config import KV_SCALE_PROMPTS
from engine import RolloutEngine, snapshot
from models import Prompt, format_prompt
from rollout import Rollout


def step_generator(seed: int, step: int, device) -> torch.Generator:
    """A generator that depends only on (seed, step): a resumed run draws exactly what it would have."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + step)


def train_rollout(pair, engine: RolloutEngine, cfg, step: int, device):
    """Sample this step's batch with the engine: `batch_size` prompts, each `samples_per_prompt` times
    (consecutive rows, so a prompt's responses form a group). Returns the rollout and each row's Prompt."""
    gen = step_generator(cfg.seed, step, "cpu")
    pick = torch.randint(len(pair.train_prompts), (cfg.batch_size,), generator=gen)
    prompts = [pair.train_prompts[i] for i in pick.tolist() for _ in range(cfg.samples_per_prompt)]
    texts = [format_prompt(pair.tokenizer, p.text) for p in prompts]
    return engine.generate(texts, generator=step_generator(cfg.seed, step, device)), prompts


class Batches:
    """Where step s's batch comes from. The weights entering step s are version s − 1.

    sync   at the start of step s: engine.sync(version s − 1), then sample.
    async  one-step-off: while the trainer runs step s, a background thread samples step s+1's batch from
           version s − 1 (the weights entering step s), so every batch is exactly one version staler than
           in sync mode (version max(s − 2, 0)); the batches are the ones sync mode with staleness + 1
           would draw. The trainer snapshots its weights before the update; the worker rebuilds the engine.
    On a GPU the worker queues its kernels on a CUDA stream of its own, so sampling overlaps the trainer's
    kernels instead of queueing behind them on the default stream: it waits only for the snapshot's copies
    (an event recorded after them), and the batch it returns is complete (stream synchronised) and marked
    as used by the trainer's stream, so the allocator does not reuse its memory too early.
    state() is what a checkpoint needs to continue exactly: the engine's last k snapshots (staleness k) and,
    in async mode, the batch the worker prepared for the next step.
    """

    def __init__(self, pair, engine: RolloutEngine, cfg, device):
        self.pair, self.engine, self.cfg, self.device = pair, engine, cfg, device
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout") if cfg.async_rollout else None
        on_gpu = cfg.async_rollout and torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_gpu else None  # async on a GPU: the worker's stream
        self.pending = None  # async: the future of the next step's batch

    def _submit(self, student, version: int, step: int) -> Future:
        """Snapshot the weights (on the trainer's stream) and let the worker sample step's batch from them."""
        weights = snapshot(student)
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # after the snapshot's copies, on the trainer's (current) stream
        return self.pool.submit(self._sample, version, weights, step, ready)

    def _sample(self, version: int, weights: dict, step: int, ready=None):
        if self.stream is None:
            self.engine.receive(version, weights)
            return train_rollout(self.pair, self.engine, self.cfg, step=step, device=self.device)
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            self.engine.receive(version, weights)
            rollout, prompts = train_rollout(self.pair, self.engine, self.cfg, step=step, device=self.device)
        trainer_stream = torch.cuda.default_stream(self.stream.device)
        for value in rollout.__dict__.values():
            if torch.is_tensor(value):
                value.record_stream(trainer_stream)
        self.stream.synchronize()
        return rollout, prompts

    def get(self, student, step: int):
        """Step s's (rollout, prompts). Async: the batch prepared during step s − 1 (or, on the first step
        of a run, one sampled now from the current weights)."""
        if self.pool is None:
            self.engine.sync(student, version=step - 1)
            return train_rollout(self.pair, self.engine, self.cfg, step=step, device=self.device)
        if self.pending is None:
            self.pending = self._submit(student, version=step - 1, step=step)
        batch, self.pending = self.pending.result(), None
        return batch

    def prefetch(self, student, step: int) -> None:
        """Async: start sampling step s+1's batch from the weights entering step s (before the update)."""
        if self.pool is not None and step < self.cfg.steps:
            self.pending = self._submit(student, version=step - 1, step=step + 1)

    def wait(self) -> None:
        """Let the worker finish (before evaluation: tokenizers are not safe to call from two threads)."""
        if self.pending is not None:
            self.pending.exception()

    def state(self) -> dict:
        self.wait()
        k = self.cfg.rollout.staleness
        kept = list(self.engine.snapshots)[len(self.engine.snapshots) - k :] if k else []
        snapshots = [[v, w] for v, w in kept]
        batch = None
        if self.pending is not None:
            rollout, prompts = self.pending.result()
            batch = {"rollout": dict(rollout.__dict__), "prompts": [[p.text, p.answer] for p in prompts]}
        return {"snapshots": snapshots, "pending": batch}

    def restore(self, state: dict) -> None:
        self.engine.snapshots.extend((int(v), w) for v, w in state["snapshots"])
        if state["pending"] is not None:
            self.pending = Future()
            prompts = [Prompt(text, answer) for text, answer in state["pending"]["prompts"]]
            self.pending.set_result((Rollout(**state["pending"]["rollout"]), prompts))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def make_engine(pair, cfg) -> RolloutEngine:
    """The rollout engine; fp8 KV scales are calibrated on the first config.KV_SCALE_PROMPTS training prompts,
    never eval ones."""
    probes = [format_prompt(pair.tokenizer, p.text) for p in pair.train_prompts[:KV_SCALE_PROMPTS]]
    return RolloutEngine(pair.student, pair.tokenizer, cfg.rollout, probe_prompts=probes)
