"""quilt.rl on Ray: environments on Ray actors (a local `ray.init()`, as a cluster or KubeRay would
serve them), an actor killed mid-step, and a reward computed by a Ray task."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import quilt
from quilt import rl
from rlfakes import FakeSampler, FakeTrainer
from test_rl_envs import Forking, crashing_group, forking_group

ray = pytest.importorskip("ray", reason="the Ray executor's tests need ray (the test extra installs it)")

pytestmark = pytest.mark.stack  # a local Ray: other processes, not in the fast tier

PARAMS = quilt.SamplingParams(max_tokens=3)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # The workers import the environments' module by name, as a cluster's would from its runtime_env.
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def test_ray_actors_hold_the_environments_and_a_dead_actor_is_replaced():
    async def main():
        actors = rl.RayActors(actors=2)
        sampler = FakeSampler(0, random.Random(0))
        try:
            group = await actors.start_group(forking_group, 1, 4, rl.EpisodeBudget())
            assert (group.cold, group.forks) == (1, 3)
            done = await rl.rollout_group(1, sampler, group, PARAMS)
            pids = {e.metrics["pid"] for e in done.episodes}
            assert len(pids) == 1 and os.getpid() not in pids and Forking.resets == 0
            crashed = await rl.rollout_group(2, sampler, await actors.start_group(crashing_group, 2, 3,
                                                                                  rl.EpisodeBudget()), PARAMS)
            assert [(e.outcome, e.cause) for e in crashed.episodes] == [("infra_failure", "worker_lost")] * 3
            again = [await rl.rollout_group(i, sampler, await actors.start_group(crashing_group, i, 2,
                                                                                 rl.EpisodeBudget()), PARAMS)
                     for i in (3, 5, 7)]
            assert all(e.outcome != "infra_failure" for g in again for e in g.episodes)
            assert actors.replaced == 1
        finally:
            await actors.aclose()

    asyncio.run(main())


def _grade(items: list[dict]) -> list[float]:
    # Runs as a Ray task: the share of sampled tokens below 5, and where it ran.
    return [{"reward": sum(t < 5 for t in item["turns"][-1]) / len(item["turns"][-1]), "outcome": "success"}
            for item in items]


def test_a_ray_task_rewards_each_group_and_the_pipeline_runs_on_actors():
    trainer = FakeTrainer(random.Random(2))
    actors = rl.RayActors(actors=2)
    config = rl.RLConfig(group_size=4, groups_per_batch=2, max_staleness=1, log_to_server=False,
                         executor=actors, warm_groups=4, reward=rl.RayReward(_grade, num_cpus=0.1))
    try:
        logs = asyncio.run(rl.run_grpo(trainer, forking_group, config, steps=3))
    finally:
        asyncio.run(actors.aclose())
    assert len(logs) == 3 and all(entry.reward_s > 0 for entry in logs)
    assert sum(entry.forks for entry in logs) == 3 * 2 * 3 and sum(entry.warm_groups for entry in logs) >= 1
    assert all(entry.outcomes.get("infra_failure", 0) == 0 for entry in logs)
