"""In-process stand-ins for the sampler and trainer quilt.rl drives: they keep a policy version as
the server does (every optimizer step +1, every published sampler tagged with it) and finish sample
requests after random delays, so groups complete out of order as long-tail rollouts do. The same
pipeline runs against the real stack in tests/test_rl_stack.py."""

from __future__ import annotations

import asyncio
import random

import quilt


class FakeSampler:
    """Samples `n` sequences of fixed tokens after a random delay, tagged with its version."""

    def __init__(self, version: int, rng: random.Random, fail: bool = False, answer: Exception | None = None) -> None:
        self.policy_version = version
        self.rng = rng
        self.fail = fail
        self.answer = answer  # what the future fails with, if anything
        self.requests = 0
        self.deadlines: list[float | None] = []
        self.episodes: list[tuple[str | None, str | None]] = []

    async def sample_async(self, prompt, n, params, deadline_s=None, episode_id=None, episode_hint=None):
        self.requests += 1
        self.deadlines.append(deadline_s)
        self.episodes.append((episode_id, episode_hint))
        if self.fail:
            raise quilt.ServerRequestError("engine died", category="server")
        if self.answer is not None:
            async def failed():
                raise self.answer
            return failed()
        delay = self.rng.lognormvariate(-5, 1.0)
        version = self.policy_version

        async def result():
            await asyncio.sleep(delay)
            return quilt.SampleResponse(sequences=[
                quilt.SampledSequence(tokens=[self.rng.randrange(10) for _ in range(3)], logprobs=[-1.0] * 3,
                                      stop_reason="length", model_id="m", policy_version=version)
                for _ in range(n)])
        return result()


class FakeTrainer:
    """Duck-types the TrainingClient methods run_grpo uses, keeping a policy version."""

    def __init__(self, rng: random.Random) -> None:
        self.version = 0
        self.rng = rng
        self.trained: list[tuple[int, list[int]]] = []  # (version at training, datum versions)
        self.samplers: list[FakeSampler] = []

    async def save_weights_and_get_sampling_client_async(self):
        await asyncio.sleep(0.001)
        sampler = FakeSampler(self.version, self.rng)
        self.samplers.append(sampler)
        return sampler

    async def forward_backward_async(self, data, loss_fn, config):
        assert loss_fn == "importance_sampling" and config["max_staleness"] >= 0
        self.trained.append((self.version, [d.policy_version for d in data]))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(quilt.ForwardBackwardOutput("", [], {"loss:sum": 1.0, "mismatch_kl:mean": 0.0}))
        return fut

    async def optim_step_async(self, adam):
        await asyncio.sleep(self.rng.uniform(0, 0.01))
        self.version += 1
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(quilt.OptimStepResult())
        return fut
