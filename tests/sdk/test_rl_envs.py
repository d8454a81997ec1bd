"""Environments at scale without a server: bounds and their outcomes, forks, the warm pool, reward
functions (local, HTTP), and the process-pool executor with real worker processes (a crash
included). Ray's executor and reward are in test_rl_ray.py; the stack runs in test_rl_stack.py."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import quilt
from quilt import rl
from quilt.rl.bounds import CAUSES, RETRIED
from rlfakes import FakeSampler, FakeTrainer

PARAMS = quilt.SamplingParams(max_tokens=3)


def run(coro):
    return asyncio.run(coro)


# -- pure rules ---------------------------------------------------------------------------


@pytest.mark.parametrize("cause, outcome", [
    ("reset_error", "infra_failure"), ("reset_timeout", "infra_failure"), ("worker_lost", "infra_failure"),
    ("step_error", "infra_failure"), ("step_timeout", "infra_failure"), ("env_reported", "infra_failure"),
    ("reward_error", "infra_failure"), ("reward_timeout", "infra_failure"), ("sample_error", "infra_failure"),
    ("sample_deadline", "infra_failure"), ("max_turns", "model_failure"), ("max_tokens", "model_failure"),
    ("wall_time", "infra_failure"),
])
def test_each_breach_has_its_outcome(cause, outcome):
    assert rl.breach_outcome(cause, rl.EpisodeBudget()) == outcome


def test_the_table_covers_every_cause_and_wall_time_is_configurable():
    assert set(RETRIED) < set(CAUSES)
    budget = rl.EpisodeBudget(wall_time_outcome="model_failure")
    assert rl.breach_outcome("wall_time", budget) == "model_failure"
    with pytest.raises(ValueError, match="unknown cause"):
        rl.breach_outcome("gremlins", budget)


@pytest.mark.parametrize("kwargs, field", [
    ({"reset_timeout_s": 0}, "reset_timeout_s"), ({"reward_timeout_s": float("nan")}, "reward_timeout_s"),
    ({"max_episode_s": -1}, "max_episode_s"), ({"wall_time_outcome": "success"}, "wall_time_outcome"),
    ({"max_infra_retries": 11}, "max_infra_retries"), ({"max_infra_retries": -1}, "max_infra_retries"),
    ({"step_timeout_s": float("inf") * 0}, "step_timeout_s"),
])
def test_budgets_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        rl.EpisodeBudget(**kwargs)


@pytest.mark.parametrize("start_s, rate, burst, cap, want", [
    (None, None, 8, 64, 8),  # nothing measured yet: one burst
    (2.0, 1.0, 8, 64, 8),  # 2 s x 1 group/s x 1.5 = 3 < burst
    (2.0, 10.0, 8, 64, 30),  # 2 s x 10 groups/s x 1.5
    (2.0, 100.0, 8, 64, 64),  # capped
    (0.0, 10.0, 4, 64, 4),  # instant starts: the burst still
    (2.0, 0.0, 4, 64, 4),
])
def test_pool_target(start_s, rate, burst, cap, want):
    assert rl.pool_target(start_s=start_s, groups_per_s=rate, burst=burst, cap=cap) == want


def test_rl_config_refuses_bad_pool_and_reward_settings():
    for bad in (-1, 5000, "warm", True, 1.5):
        with pytest.raises(ValueError, match="warm_groups"):
            rl.RLConfig(warm_groups=bad)
    with pytest.raises(ValueError, match="reward"):
        rl.RLConfig(reward=lambda items: [0.0] * len(items))
    with pytest.raises(ValueError, match="QUILT_RL_EXECUTOR"):
        rl.make_executor("threads")


# -- environments used below (module level: the process pool pickles them by reference) ----


class Counted(rl.Env):
    """Resets take ``start_s``; steps answer the share of tokens below 5. Counts its starts."""

    resets = 0
    forks = 0

    def __init__(self, task: int, start_s: float = 0.0, fail_resets: int = 0) -> None:
        self.task, self.start_s, self.fail_resets = task, start_s, fail_resets
        self.state: list[int] = []

    async def reset(self):
        type(self).resets += 1
        await asyncio.sleep(self.start_s)
        if self.fail_resets > 0:
            raise ConnectionError("sandbox did not boot")
        self.state = [self.task, 1]
        return [self.task, 1]

    async def step(self, tokens):
        return rl.StepResult(reward=sum(t < 5 for t in tokens) / max(1, len(tokens)),
                             metrics={"pid": float(os.getpid())}, info={"task": self.task})


class Forking(Counted):
    async def snapshot(self):
        return list(self.state)

    async def fork(self, snapshot):
        type(self).forks += 1
        twin = Forking(self.task)
        twin.state = list(snapshot)
        return twin


def forking_group(index, n):
    return [Forking(index) for _ in range(n)]


def counted_group(index, n):
    return [Counted(index) for _ in range(n)]


class Crashing(Counted):
    async def step(self, tokens):
        if self.task % 2 == 0:
            os._exit(3)  # the worker dies mid-step (a segfault, the OOM killer)
        return await super().step(tokens)


def crashing_group(index, n):
    return [Crashing(index) for _ in range(n)]


class Hanging(Counted):
    async def step(self, tokens):
        await asyncio.sleep(30)


def hanging_group(index, n):
    return [Hanging(index) for _ in range(n)]


@pytest.fixture(autouse=True)
def _counts():
    Counted.resets = Forking.resets = Forking.forks = 0
    yield


# -- forks and retries --------------------------------------------------------------------


def test_a_forkable_group_starts_from_one_reset():
    group = run(rl.start_group(forking_group, 3, 8, rl.EpisodeBudget()))
    assert (group.cold, group.forks) == (1, 7) and Forking.resets == 1 and Forking.forks == 7
    assert [m.prompt for m in group.members] == [[3, 1]] * 8
    assert len({id(m.env) for m in group.members}) == 8
    cold = run(rl.start_group(forking_group, 3, 8, rl.EpisodeBudget(), fork=False))
    assert (cold.cold, cold.forks) == (8, 0)
    plain = run(rl.start_group(counted_group, 3, 8, rl.EpisodeBudget()))
    assert (plain.cold, plain.forks) == (8, 0) and Counted.resets == 8


def test_failed_resets_are_retried_with_a_new_environment_then_counted():
    failures = {"left": 2}

    def flaky(index, n):
        envs = []
        for _ in range(n):
            envs.append(Counted(index, fail_resets=1 if failures["left"] > 0 else 0))
            failures["left"] -= 1
        return envs

    group = run(rl.start_group(flaky, 0, 4, rl.EpisodeBudget()))
    assert all(m.env is not None for m in group.members)
    assert group.retries == {"reset_error": 2} and group.cold == 6

    def broken(index, n):
        return [Counted(index, fail_resets=1) for _ in range(n)]

    group = run(rl.start_group(broken, 0, 2, rl.EpisodeBudget(max_infra_retries=1)))
    assert [m.cause for m in group.members] == ["reset_error", "reset_error"]
    assert "sandbox did not boot" in group.members[0].error and group.retries == {"reset_error": 2}
    slow = run(rl.start_group(lambda i, n: [Counted(i, start_s=1.0) for _ in range(n)], 0, 2,
                              rl.EpisodeBudget(reset_timeout_s=0.05, max_infra_retries=0)))
    assert [m.cause for m in slow.members] == ["reset_timeout"] * 2


def test_reset_answers_that_are_not_token_ids_are_the_environments_bug():
    class Texty(Counted):
        async def reset(self):
            return "What is 2+2?"

    group = run(rl.start_group(lambda i, n: [Texty(i) for _ in range(n)], 0, 2,
                               rl.EpisodeBudget(max_infra_retries=0)))
    assert [m.cause for m in group.members] == ["reset_error"] * 2 and "not token ids" in group.members[0].error


# -- the warm pool ------------------------------------------------------------------------


def test_the_warm_pool_has_groups_ready_and_hands_them_out_in_order():
    async def main():
        starts = []

        async def start(index):
            starts.append(index)
            return await rl.start_group(lambda i, n: [Counted(i, start_s=0.2) for _ in range(n)], index, 2,
                                        rl.EpisodeBudget())

        pool = rl.WarmPool(start, 3, burst=2)
        first = await pool.take(0)  # cold: waited for its start
        assert first.start_s >= 0.19 and not first.warm
        await asyncio.sleep(0.3)  # meanwhile the pool started 1..3
        taken = [await pool.take(i) for i in (1, 2)]
        assert all(g.warm and g.start_s < 0.05 for g in taken)
        assert [g.index for g in taken] == [1, 2] and [m.prompt for m in taken[0].members] == [[1, 1]] * 2
        assert pool.hits == 2 and starts[:4] == [0, 1, 2, 3]
        await pool.aclose()
        return pool

    pool = run(main())
    assert pool.started >= 4


def test_an_auto_pool_grows_with_demand():
    async def main():
        async def start(index):
            await asyncio.sleep(0.1)
            return rl.StartedGroup(index, [])

        pool = rl.WarmPool(start, "auto", burst=2, cap=40)
        assert pool.target == 2
        for i in range(10):  # 10 groups/s against 0.1 s starts: 1.5 wanted, the burst holds
            await pool.take(i)
            await asyncio.sleep(0.1)
        assert pool.target == 2
        for i in range(10, 30):  # about 100 groups/s: 15 wanted
            await pool.take(i)
            await asyncio.sleep(0.01)
        assert 8 <= pool.target <= 20
        await pool.aclose()

    run(main())


def test_a_pool_starts_nothing_ahead_past_its_limit_but_still_starts_a_group_taken_past_it():
    async def main():
        async def start(index):
            await asyncio.sleep(0.01)
            return rl.StartedGroup(index, [])

        pool = rl.WarmPool(start, 8, burst=2, limit=6)
        for i in range(6):
            await pool.take(i)
        assert pool.started == 6  # 8 ahead were wanted; the run uses 6
        extra = await pool.take(9)  # a replacement past the limit starts on demand (with those before it)
        assert extra.index == 9 and pool.started == 10
        await pool.aclose()

    run(main())


# -- bounds in a rollout ------------------------------------------------------------------


def test_wall_time_budget_ends_episodes_with_its_outcome():
    class Slow(Counted):
        async def step(self, tokens):
            await asyncio.sleep(0.3)
            return rl.StepResult(reward=0.0, done=False, next_prompt=[1, 2])

    for outcome in ("infra_failure", "model_failure"):
        budget = rl.EpisodeBudget(max_turns=10, max_episode_s=0.5, wall_time_outcome=outcome)
        began = time.monotonic()
        group = run(rl.rollout_group(0, FakeSampler(0, random.Random(0)), [Slow(0), Slow(0)], PARAMS, budget))
        assert time.monotonic() - began < 2.0
        assert [(e.outcome, e.cause) for e in group.episodes] == [(outcome, "wall_time")] * 2


def test_failed_sampling_is_retried_before_the_episodes_are_dropped():
    class Flaky(FakeSampler):
        def __init__(self, failures):
            super().__init__(0, random.Random(0))
            self.failures = failures

        async def sample_async(self, *args, **kwargs):
            if self.failures > 0:
                self.failures -= 1
                raise quilt.ServerRequestError("engine restarting", category="server")
            return await super().sample_async(*args, **kwargs)

    group = run(rl.rollout_group(0, Flaky(2), [Counted(0), Counted(0)], PARAMS, rl.EpisodeBudget()))
    assert all(e.outcome != "infra_failure" for e in group.episodes) and group.retries == {"sample_error": 2}
    group = run(rl.rollout_group(0, Flaky(5), [Counted(0), Counted(0)], PARAMS, rl.EpisodeBudget(max_infra_retries=1)))
    assert [e.cause for e in group.episodes] == ["sample_error"] * 2 and group.retries == {"sample_error": 1}


def test_an_environment_reporting_infra_is_counted_as_such():
    class Says(Counted):
        async def step(self, tokens):
            return rl.StepResult(reward=0.0, outcome="infra_failure")

    group = run(rl.rollout_group(0, FakeSampler(0, random.Random(0)), [Says(0), Says(0)], PARAMS))
    assert [e.cause for e in group.episodes] == ["env_reported"] * 2


# -- reward functions ---------------------------------------------------------------------


def test_a_local_reward_scores_the_group_once_and_adds_to_the_env_reward():
    calls = []

    def grade(items):
        calls.append(items)
        return [{"reward": 1.0, "outcome": "success"} if item.info["task"] == 4 else 0.5 for item in items]

    sampler = FakeSampler(0, random.Random(0))
    group = run(rl.rollout_group(4, sampler, [Counted(4) for _ in range(3)], PARAMS,
                                 reward=rl.LocalReward(grade)))
    assert len(calls) == 1 and len(calls[0]) == 3
    item = calls[0][0]
    assert item.prompt == [4, 1] and len(item.turns) == 1 and len(item.turns[0]) == 3
    assert all(e.reward == pytest.approx(item.env_reward + 1.0) for e, item in zip(group.episodes, calls[0]))
    assert group.reward_s > 0 and group.env_s >= group.reward_s


@pytest.mark.parametrize("answer, cause", [
    (lambda items: [0.0], "reward_error"),  # one reward for three episodes
    (lambda items: [float("nan")] * len(items), "reward_error"),
    (lambda items: [{"reward": 1.0, "outcome": "great"}] * len(items), "reward_error"),
    (lambda items: time.sleep(1.0) or [0.0] * len(items), "reward_timeout"),
])
def test_reward_failures_are_retried_then_infra(answer, cause):
    calls = []

    def grade(items):
        calls.append(1)
        return answer(items)

    budget = rl.EpisodeBudget(reward_timeout_s=0.2, max_infra_retries=1)
    group = run(rl.rollout_group(0, FakeSampler(0, random.Random(0)), [Counted(0) for _ in range(3)], PARAMS, budget,
                                 reward=rl.LocalReward(grade)))
    assert [(e.outcome, e.cause) for e in group.episodes] == [("infra_failure", cause)] * 3
    assert len(calls) == 2 and group.retries == {cause: 1}


class _Grader(BaseHTTPRequestHandler):
    """A grader service: the reward is the share of the reply's tokens below 5, plus one when the
    environment's info names task 7."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        rewards = [sum(t < 5 for t in item["turns"][-1]) / len(item["turns"][-1]) + (item["info"].get("task") == 7)
                   for item in body["items"]]
        data = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_an_http_reward_is_one_post_per_group():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Grader)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        class Silent(Counted):
            async def step(self, tokens):
                return rl.StepResult(reward=0.0, info={"task": self.task})

        reward = rl.HTTPReward(f"http://127.0.0.1:{server.server_port}/grade", decode=lambda t: " ".join(map(str, t)))
        group = run(rl.rollout_group(7, FakeSampler(0, random.Random(3)), [Silent(7) for _ in range(4)], PARAMS,
                                     reward=reward))
        assert len(server.seen) == 1 and len(server.seen[0]["items"]) == 4
        assert server.seen[0]["items"][0]["text"][0] == " ".join(map(str, group.episodes[0].turns[0].tokens))
        for e in group.episodes:
            assert e.reward == pytest.approx(1 + sum(t < 5 for t in e.turns[0].tokens) / 3)
        dead = rl.HTTPReward(f"http://127.0.0.1:{server.server_port}/grade".replace(str(server.server_port), "9"))
        group = run(rl.rollout_group(7, FakeSampler(0, random.Random(3)), [Silent(7), Silent(7)], PARAMS,
                                     rl.EpisodeBudget(max_infra_retries=0), reward=dead))
        assert [e.cause for e in group.episodes] == ["reward_error"] * 2
    finally:
        server.shutdown()


# -- the process pool ---------------------------------------------------------------------


@pytest.mark.stack  # other processes: not in the fast tier
def test_process_workers_hold_the_environments_and_replace_a_crashed_one():
    async def main():
        pool = rl.ProcessPool(workers=2)
        try:
            sampler = FakeSampler(0, random.Random(0))
            group = await pool.start_group(forking_group, 1, 4, rl.EpisodeBudget())
            assert (group.cold, group.forks) == (1, 3) and Forking.resets == 0  # not in this process
            done = await rl.rollout_group(1, sampler, group, PARAMS)
            pids = {e.metrics["pid"] for e in done.episodes}
            assert len(pids) == 1 and os.getpid() not in pids
            assert all(e.outcome != "infra_failure" for e in done.episodes)
            # Task 2's worker dies mid-step: its episodes are worker_lost, nothing waits on it.
            crashed = await rl.rollout_group(2, sampler, await pool.start_group(crashing_group, 2, 3,
                                                                                rl.EpisodeBudget()), PARAMS)
            assert [(e.outcome, e.cause) for e in crashed.episodes] == [("infra_failure", "worker_lost")] * 3
            # The next groups run on a replacement.
            again = [await rl.rollout_group(i, sampler, await pool.start_group(crashing_group, i, 2,
                                                                               rl.EpisodeBudget()), PARAMS)
                     for i in (3, 5)]
            assert all(e.outcome != "infra_failure" for g in again for e in g.episodes)
            assert pool.replaced == 1
            # A step past its limit is cancelled on the worker, and the worker keeps serving.
            hung = await rl.rollout_group(9, sampler, await pool.start_group(hanging_group, 9, 2, rl.EpisodeBudget()),
                                          PARAMS, rl.EpisodeBudget(step_timeout_s=0.3))
            assert [e.cause for e in hung.episodes] == ["step_timeout"] * 2
            assert sum(w.envs for w in pool._slots) == 0  # every group released its environments
        finally:
            await pool.aclose()

    run(main())


@pytest.mark.stack  # other processes: not in the fast tier
def test_the_pipeline_runs_on_process_workers_with_a_warm_pool_and_forks():
    trainer = FakeTrainer(random.Random(1))
    config = rl.RLConfig(group_size=4, groups_per_batch=3, max_staleness=1, log_to_server=False,
                         executor=rl.ProcessPool(workers=2), warm_groups="auto")
    try:
        logs = run(rl.run_grpo(trainer, forking_group, config, steps=4))
    finally:
        run(config.executor.aclose())
    assert len(logs) == 4 and all(entry.groups == 3 for entry in logs)
    assert sum(entry.forks for entry in logs) == 4 * 3 * 3 and sum(entry.cold_starts for entry in logs) == 4 * 3
    assert sum(entry.warm_groups for entry in logs) > 0
    assert all(entry.env_start_s >= 0 and entry.env_step_s >= 0 and entry.env_wait_gpu_s >= 0 for entry in logs)
    assert Forking.resets == 0  # every environment lived on a worker


@pytest.mark.stack  # other processes: not in the fast tier
def test_a_builder_error_on_a_worker_stops_the_run():
    def broken(index, n):
        raise KeyError("no such task")

    config = rl.RLConfig(group_size=2, groups_per_batch=1, log_to_server=False, executor="processes")
    with pytest.raises(RuntimeError, match="no such task"):
        run(rl.run_grpo(FakeTrainer(random.Random(0)), broken, config, steps=1))


def test_the_public_surface_of_quilt_rl_is_documented():
    from quilt.rl import adapters

    for module in (rl, adapters):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert inspect.getdoc(obj), name
                for attr, member in vars(obj).items():
                    if (inspect.isfunction(member) or isinstance(member, property)) and not attr.startswith("_"):
                        assert inspect.getdoc(member), f"{name}.{attr}"


@pytest.mark.stack  # other processes: not in the fast tier
def test_one_process_pool_serves_runs_one_after_another():
    pool = rl.ProcessPool(workers=1)
    config = rl.RLConfig(group_size=2, groups_per_batch=2, max_staleness=0, log_to_server=False, executor=pool)
    try:
        for seed in (1, 2):  # each train_grpo runs in an event loop of its own
            logs = rl.train_grpo(FakeTrainer(random.Random(seed)), counted_group, config, steps=2)
            assert all(entry.outcomes.get("infra_failure", 0) == 0 for entry in logs)
    finally:
        run(pool.aclose())
    assert pool.replaced == 0


def test_each_steps_causes_are_recorded_with_the_run():
    class Recording(FakeTrainer):
        def __init__(self, rng):
            super().__init__(rng)
            self.logged: list[dict] = []

        async def log_metrics_async(self, metrics, step=None):
            self.logged.append(dict(metrics))

    class Broken(Counted):
        async def step(self, tokens):
            raise ConnectionError("tool server gone")

    def make_group(index, n):
        return [Broken(index) if i == 0 else Counted(index) for i in range(n)]

    trainer = Recording(random.Random(3))
    config = rl.RLConfig(group_size=3, groups_per_batch=2, max_staleness=0)
    logs = run(rl.run_grpo(trainer, make_group, config, steps=2))
    assert all(entry.infra_causes == {"step_error": 2} for entry in logs)
    assert [m["infra/step_error"] for m in trainer.logged] == [2.0, 2.0]
    assert all({"env_start_s", "env_step_s", "reward_s", "sample_s", "train_s", "env_wait_gpu_s"} <= set(m)
               for m in trainer.logged)


def test_an_environment_that_will_not_close_does_not_hold_its_group(monkeypatch):
    from quilt.rl import starts

    monkeypatch.setattr(starts, "CLOSE_TIMEOUT_S", 0.2)
    closed = []

    class Stuck(Counted):
        async def close(self):
            await asyncio.sleep(60)

    class Plain(Counted):
        def close(self):  # a plain close runs in a thread
            closed.append(self.task)

    began = time.monotonic()
    group = run(rl.rollout_group(0, FakeSampler(0, random.Random(0)), [Stuck(0), Stuck(0), Plain(5)], PARAMS))
    assert time.monotonic() - began < 2.0 and len(group.episodes) == 3 and closed == [5]


def test_an_observation_sets_its_turns_stop_condition():
    class Recording(FakeSampler):
        def __init__(self):
            super().__init__(0, random.Random(0))
            self.stops = []

        async def sample_async(self, prompt, n, params, **kwargs):
            self.stops.append((n, params.stop))
            return await super().sample_async(prompt, n, params, **kwargs)

    class Tool(Counted):
        async def reset(self):
            await super().reset()
            return rl.Observation([self.task, 1], stop=["</call>"])

        async def step(self, tokens):
            if self.state[-1] == 1:  # the call was made: the answer ends at the model's own end
                self.state.append(2)
                return rl.StepResult(reward=0.0, done=False, next_prompt=rl.Observation([self.task, 2]))
            return rl.StepResult(reward=1.0)

    sampler = Recording()
    group = run(rl.rollout_group(0, sampler, [Tool(3), Tool(3)], quilt.SamplingParams(max_tokens=3, stop=["\n"]),
                                 rl.EpisodeBudget(max_turns=3)))
    assert sampler.stops == [(2, ["</call>"]), (2, ["\n"])] and all(len(e.turns) == 2 for e in group.episodes)
    with pytest.raises(ValueError, match="stop condition"):
        rl.prompt_stop(rl.Observation([1], stop=["a", 1]))
