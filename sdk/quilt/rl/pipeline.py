"""The GRPO training loop, asynchronous with bounded staleness.

Sampling and training overlap: while the trainer runs step ``k``, rollouts for the next steps are
already being sampled. Overlap makes data off-policy, so it is bounded: a group is only started when
it will be trained at most ``max_staleness`` policy versions after the version that samples it.
``max_staleness=0`` is the synchronous loop (sample, train, publish, repeat).

How the bound is kept (the rule is :func:`may_start_group`, a pure function): the trainer has
consumed batches up to step ``c - 1``, so a group started now feeds step ``c + q // B`` at the latest
in order of starting, where ``q`` groups are already ahead of it (finished, not yet trained, or
still running) and ``B`` groups make a batch. It starts only if that step minus the newest published
version is within the bound. Groups can finish out of order (that is the long tail), so the trainer
also checks each group when it forms a batch, takes the oldest first, and drops and counts any that
fell past the bound anyway.

Weights are updated in flight: after each optimizer step the new weights are published and every
group started afterwards samples them, while groups already running finish on the version they began
with (the generation pool keeps both). Every step logs time-to-trainable-batch, staleness, the
trainer's mismatch KL, the mean reward, the fraction of zero-advantage groups and the infra-failure
rate, and where the time went (environment starts, steps and rewards against sampling and training);
``log_to_server`` also records them with the run, for the dashboard.

Environments run where ``executor`` says (:mod:`quilt.rl.executors`); with ``warm_groups`` a pool
starts the next groups ahead of demand, and forkable environments start a group from one reset
(:mod:`quilt.rl.starts`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..sampling import SamplingClient, SamplingParams
from ..training import TrainingClient
from ..types import AdamParams, Datum
from .bounds import EpisodeBudget
from .env import GroupBuilder
from .executors import Executor, make_executor
from .grpo import episode_datums, plan_group
from .rewards import RewardFn
from .rollouts import SampledGroup, rollout_group
from .starts import StartedGroup, WarmPool

__all__ = ["RLConfig", "StepLog", "may_start_group", "run_grpo", "train_grpo"]

log = logging.getLogger("quilt.rl")


@dataclass(frozen=True)
class RLConfig:
    """Settings of :func:`run_grpo`.

    Attributes:
        group_size: episodes per GRPO group (one ``sample(n)`` request on the first turn).
        groups_per_batch: groups per training step.
        max_staleness: how many policy versions sampling may run ahead of training; 0 is on-policy.
        sampling: sampling parameters of every turn.
        loss_fn: an RL loss of the server (``importance_sampling``, ``ppo``, ``cispo``, ``dro``).
        loss_fn_config: passed to the loss (e.g. ``{"is_weight_cap": 2.0}``); ``max_staleness`` is
            added so the trainer drops anything past the bound.
        adam: optimizer settings of every step.
        normalize_advantages: divide group-relative advantages by the group's reward std.
        budget: per-step timeout and per-episode limits.
        max_concurrent_groups: groups sampling at once; default ``groups_per_batch * (max_staleness + 1)``.
        log_to_server: record each step's metrics with the run (shown by the dashboard).
        episode_priority: send each group's episode id with its sampling calls, so the pool serves
            groups that have consumed fewer tokens first (feedback levels). Off by default: in a
            streamed run (``max_staleness >= 1``) it halves the median group's latency but
            lengthens the longest tenth's by about half (staler, more often dropped at the bound);
            in a synchronous run it lengthens the batch, whose slowest group it delays
            (bench/genpool_episodes.py).
        executor: where environments run: ``"inprocess"``, ``"processes"``, ``"ray"`` or an executor
            object (:mod:`quilt.rl.executors`); None reads ``QUILT_RL_EXECUTOR`` (default in process).
            An executor named by a string is closed with the run; an object is left to its owner.
        warm_groups: groups a warm pool keeps starting or ready ahead of demand: 0 starts each group
            when it is needed, an integer keeps that many, ``"auto"`` sizes the pool from the measured
            start time and the rate groups are asked for (at least ``concurrency``).
        fork: start a group of forkable environments from one reset and ``group_size - 1`` forks.
        reward: a reward function called once per group (:mod:`quilt.rl.rewards`): local, Ray, HTTP.
    """

    group_size: int = 8
    groups_per_batch: int = 8
    max_staleness: int = 1
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=16))
    loss_fn: str = "importance_sampling"
    loss_fn_config: dict[str, float] | None = None
    adam: AdamParams = field(default_factory=AdamParams)
    normalize_advantages: bool = False
    budget: EpisodeBudget = field(default_factory=EpisodeBudget)
    max_concurrent_groups: int | None = None
    log_to_server: bool = True
    episode_priority: bool = False
    executor: str | Executor | None = None
    warm_groups: int | Literal["auto"] = 0
    fork: bool = True
    reward: RewardFn | None = None

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative to the group), got {self.group_size}")
        if self.groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be >= 1, got {self.groups_per_batch}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_concurrent_groups is not None and self.max_concurrent_groups < 1:
            raise ValueError(f"max_concurrent_groups must be >= 1, got {self.max_concurrent_groups}")
        if self.warm_groups != "auto" and (isinstance(self.warm_groups, bool) or not isinstance(self.warm_groups, int)
                                           or not 0 <= self.warm_groups <= 4096):
            raise ValueError(f"warm_groups must be 'auto' or an integer within [0, 4096], got {self.warm_groups!r}")
        if self.reward is not None and not callable(getattr(self.reward, "score", None)):
            raise ValueError("reward must have an async score(items) method (quilt.rl.rewards)")

    @property
    def concurrency(self) -> int:
        """Groups sampling at once: ``max_concurrent_groups`` or ``groups_per_batch * (max_staleness + 1)``."""
        return self.max_concurrent_groups or self.groups_per_batch * (self.max_staleness + 1)


@dataclass(frozen=True)
class StepLog:
    """One training step's record.

    ``policy_version`` is the version the step trained (its weights before the optimizer step);
    staleness is that minus the version that sampled each trained episode.

    Where the time went: ``env_s`` and ``sample_s`` are the batch's groups' wall time waiting on
    environments and on sampling (summed over groups), ``env_s`` split into ``env_start_s`` (waiting
    for environments to start), ``env_step_s`` (their steps) and ``reward_s`` (the reward
    function); ``train_s`` the step's forward_backward and optim_step. ``env_wait_share`` is env_s /
    (env_s + sample_s), the share of rollout time spent waiting on environments rather than the
    pool; ``trainer_env_wait_share`` is the share of the trainer's cycle (waiting for the batch,
    then training) spent waiting on environments, the batch wait apportioned by ``env_wait_share``;
    ``env_wait_gpu_s`` is that wait in seconds: the trainer time (per trainer GPU) the step lost to
    environments.

    ``infra_causes`` counts the episodes that ended early per cause (:mod:`quilt.rl.bounds`),
    ``retries`` the calls tried again per cause; ``cold_starts``, ``forks`` and ``warm_groups``
    say how the batch's groups started (resets, forks, groups a warm pool had ready).
    """

    step: int
    policy_version: int
    trained: bool
    seconds: float
    time_to_batch_s: float
    reward_mean: float
    zero_advantage_fraction: float
    infra_failure_rate: float
    staleness_mean: float
    staleness_max: int
    mismatch_kl: float | None
    groups: int
    groups_trained: int
    episodes: int
    datums: int
    dropped_stale: int
    outcomes: dict[str, int]
    env_metrics: dict[str, float]
    loss_per_token: float | None
    env_s: float = 0.0
    sample_s: float = 0.0
    train_s: float = 0.0
    env_start_s: float = 0.0
    env_step_s: float = 0.0
    reward_s: float = 0.0
    infra_causes: dict[str, int] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    cold_starts: int = 0
    forks: int = 0
    warm_groups: int = 0

    @property
    def env_wait_share(self) -> float:
        """env_s / (env_s + sample_s): the share of rollout time spent on environments."""
        waited = self.env_s + self.sample_s
        return self.env_s / waited if waited > 0 else 0.0

    @property
    def trainer_env_wait_share(self) -> float:
        """The share of the trainer's cycle (batch wait, then training) spent waiting on environments."""
        cycle = self.time_to_batch_s + self.train_s
        return self.time_to_batch_s * self.env_wait_share / cycle if cycle > 0 else 0.0

    @property
    def env_wait_gpu_s(self) -> float:
        """Seconds of the trainer's batch wait attributed to environments (per trainer GPU)."""
        return self.time_to_batch_s * self.env_wait_share

    def line(self) -> str:
        """A one-line human summary."""
        kl = "-" if self.mismatch_kl is None else f"{self.mismatch_kl:.2e}"
        return (f"step {self.step:3d} v{self.policy_version:<3d} reward {self.reward_mean:.3f} "
                f"zero-adv {self.zero_advantage_fraction:.2f} infra {self.infra_failure_rate:.2f} "
                f"stale {self.staleness_mean:.2f}/{self.staleness_max} kl {kl} "
                f"ttb {self.time_to_batch_s:.2f}s step {self.seconds:.2f}s env {self.env_wait_share:.0%}")


# What the run's page plots beside the trainer's loss (one curve each).
_SERVER_METRICS = ("reward_mean", "zero_advantage_fraction", "infra_failure_rate", "staleness_mean",
                   "mismatch_kl", "time_to_batch_s", "dropped_stale", "env_wait_share", "trainer_env_wait_share",
                   "env_start_s", "env_step_s", "reward_s", "sample_s", "train_s", "env_wait_gpu_s")


def may_start_group(*, consuming_step: int, queued: int, groups_per_batch: int, sampler_version: int,
                    max_staleness: int, in_flight: int, concurrency: int, groups_needed: int) -> bool:
    """Whether one more group may start sampling now (pure; see the module docstring).

    ``consuming_step`` is the version the next batch will train; ``queued`` counts groups finished
    or running that are not yet trained; ``groups_needed`` is how many more groups the remaining
    steps can use at most.
    """
    if in_flight >= concurrency or queued >= groups_needed:
        return False
    feeds_step = consuming_step + queued // groups_per_batch
    return feeds_step - sampler_version <= max_staleness


class _Pipeline:
    def __init__(self, tc: TrainingClient, make_group: GroupBuilder, config: RLConfig, steps: int,
                 on_step: Callable[[StepLog], Any] | None) -> None:
        self.tc, self.make_group, self.config, self.steps, self.on_step = tc, make_group, config, steps, on_step
        self.cond = asyncio.Condition()
        self.ready: list[SampledGroup] = []
        self.in_flight = 0
        self.next_index = 0
        self.trained_steps = 0  # batches consumed so far
        self.version = 0  # the trainer's policy version (optimizer steps of the adapter)
        self.sampler: SamplingClient | None = None
        self.sampler_version = 0
        self.error: BaseException | None = None
        self.stopping = False
        self.executor = make_executor(config.executor)
        self._owns_executor = config.executor is None or isinstance(config.executor, str)
        self.pool: WarmPool | None = None
        if config.warm_groups:
            # Never ahead past the groups the run's steps can use: each is a sandbox started for nothing.
            self.pool = WarmPool(self._start, config.warm_groups, burst=config.concurrency,
                                 limit=steps * config.groups_per_batch)
        self._batch_taken = False  # the trainer holds step `version`'s batch and has not published yet

    # -- producers ----------------------------------------------------------------------

    def _may_start(self) -> bool:
        B = self.config.groups_per_batch
        return may_start_group(
            consuming_step=self.version + (1 if self._batch_taken else 0),
            queued=len(self.ready) + self.in_flight, groups_per_batch=B,
            sampler_version=self.sampler_version, max_staleness=self.config.max_staleness,
            in_flight=self.in_flight, concurrency=self.config.concurrency,
            groups_needed=(self.steps - self.trained_steps - (1 if self._batch_taken else 0)) * B,
        )

    async def _producer(self) -> None:
        while True:
            async with self.cond:
                await self.cond.wait_for(lambda: self.stopping or self._may_start())
                if self.stopping:
                    return
                self.in_flight += 1
                index, sampler = self.next_index, self.sampler
                self.next_index += 1
            try:
                started = await (self.pool.take(index) if self.pool is not None else self._start(index))
                assert sampler is not None
                group = await rollout_group(index, sampler, started, self.config.sampling, self.config.budget,
                                            episode_priority=self.config.episode_priority, reward=self.config.reward)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # a user error (bad env builder, bad params): stop the run
                async with self.cond:
                    self.in_flight -= 1
                    self.error = self.error or exc
                    self.cond.notify_all()
                return
            async with self.cond:
                self.in_flight -= 1
                self.ready.append(group)
                self.cond.notify_all()

    def _start(self, index: int) -> Awaitable[StartedGroup]:
        return self.executor.start_group(self.make_group, index, self.config.group_size, self.config.budget,
                                         fork=self.config.fork)

    # -- trainer ------------------------------------------------------------------------

    async def _take_batch(self) -> tuple[list[SampledGroup], int]:
        B, dropped = self.config.groups_per_batch, 0
        async with self.cond:
            while True:
                if self.error is not None:
                    raise self.error
                # Oldest first, so nothing is left to age past the bound; drop what already has.
                self.ready.sort(key=lambda g: (g.policy_version if g.policy_version is not None else -1, g.index))
                fresh = [g for g in self.ready if g.policy_version is None
                         or self.version - g.policy_version <= self.config.max_staleness]
                dropped += len(self.ready) - len(fresh)
                self.ready = fresh
                if len(self.ready) >= B:
                    batch, self.ready = self.ready[:B], self.ready[B:]
                    self._batch_taken = True
                    self.cond.notify_all()
                    return batch, dropped
                self.cond.notify_all()  # dropping freed room for producers
                await self.cond.wait()

    async def _publish(self, trained: bool = True) -> None:
        # Nothing trained (every group had zero advantage): the weights did not change, so the
        # current sampler stays; only the gate moves back.
        sampler = await self.tc.save_weights_and_get_sampling_client_async() if trained else self.sampler
        async with self.cond:
            self.sampler = sampler
            if trained:
                assert sampler is not None  # the one just made from the new weights
                self.version = sampler.policy_version if sampler.policy_version is not None else self.version + 1
            self.sampler_version = self.version
            self._batch_taken = False
            self.cond.notify_all()

    async def run(self) -> list[StepLog]:
        await self._publish(trained=True)
        logs: list[StepLog] = []
        producers = [asyncio.create_task(self._producer()) for _ in range(self.config.concurrency)]
        try:
            for step in range(self.steps):
                waited = time.monotonic()
                batch, dropped = await self._take_batch()
                ready_at = time.monotonic()
                entry = await self._train(step, batch, dropped, ready_at - waited)
                await self._publish(entry.trained)
                self.trained_steps += 1
                entry = StepLog(**{**asdict(entry), "seconds": time.monotonic() - waited})
                logs.append(entry)
                await self._report(entry)
        finally:
            async with self.cond:
                self.stopping = True
                self.cond.notify_all()
            for task in producers:
                task.cancel()
            await asyncio.gather(*producers, return_exceptions=True)
            if self.pool is not None:
                await self.pool.aclose()
            if self._owns_executor:
                await self.executor.aclose()
        return logs

    async def _train(self, step: int, batch: list[SampledGroup], dropped: int, ttb: float) -> StepLog:
        cfg = self.config
        datums: list[Datum] = []
        outcomes: Counter[str] = Counter()
        rewards: list[float] = []
        lags: list[int] = []
        env_metrics: dict[str, list[float]] = {}
        statuses: Counter[str] = Counter()
        causes: Counter[str] = Counter()
        retries: Counter[str] = Counter()
        for group in batch:
            retries.update(group.retries)
            causes.update(e.cause for e in group.episodes if e.cause is not None)
            plan = plan_group(group.episodes, normalize=cfg.normalize_advantages)
            statuses[plan.status] += 1
            for episode, advantage, ok in zip(group.episodes, plan.advantages, plan.trainable):
                outcomes[episode.outcome] += 1
                for key, value in episode.metrics.items():
                    env_metrics.setdefault(key, []).append(value)
                if not ok:
                    continue
                rewards.append(episode.reward)
                if plan.status == "train":
                    new = episode_datums(episode, advantage)
                    datums.extend(new)
                    lags.extend(self.version - d.policy_version for d in new if d.policy_version is not None)
        metrics: dict[str, float] = {}
        train_started = time.monotonic()
        if datums:
            config = {**(cfg.loss_fn_config or {}), "max_staleness": cfg.max_staleness}
            fb = await self.tc.forward_backward_async(datums, cfg.loss_fn, config)
            optim = await self.tc.optim_step_async(cfg.adam)
            metrics = (await fb).metrics
            await optim
        episodes = sum(outcomes.values())
        weighted = sum(sum(d.loss_fn_inputs["weights"].data) for d in datums)
        return StepLog(
            step=step, policy_version=self.version, trained=bool(datums), seconds=0.0, time_to_batch_s=ttb,
            reward_mean=statistics.fmean(rewards) if rewards else 0.0,
            zero_advantage_fraction=statuses["zero_advantage"] / len(batch),
            infra_failure_rate=outcomes["infra_failure"] / episodes if episodes else 0.0,
            staleness_mean=statistics.fmean(lags) if lags else 0.0, staleness_max=max(lags, default=0),
            mismatch_kl=metrics.get("mismatch_kl:mean"), groups=len(batch), groups_trained=statuses["train"],
            episodes=episodes, datums=len(datums), dropped_stale=dropped + int(metrics.get("dropped_stale:sum", 0)),
            outcomes=dict(outcomes), env_metrics={k: statistics.fmean(v) for k, v in env_metrics.items()},
            loss_per_token=metrics["loss:sum"] / weighted if datums and weighted and "loss:sum" in metrics else None,
            env_s=sum(g.env_s for g in batch), sample_s=sum(g.sample_s for g in batch),
            train_s=time.monotonic() - train_started, env_start_s=sum(g.start_s for g in batch),
            env_step_s=sum(g.step_s for g in batch), reward_s=sum(g.reward_s for g in batch),
            infra_causes=dict(causes), retries=dict(retries), cold_starts=sum(g.cold for g in batch),
            forks=sum(g.forks for g in batch), warm_groups=sum(g.warm for g in batch),
        )

    async def _report(self, entry: StepLog) -> None:
        log.info("%s", entry.line())
        if self.on_step is not None:
            result = self.on_step(entry)
            if inspect.isawaitable(result):
                await result
        if self.config.log_to_server and hasattr(self.tc, "log_metrics_async"):
            numbers = {k: float(getattr(entry, k)) for k in _SERVER_METRICS if getattr(entry, k) is not None}
            numbers.update({f"env/{k}": v for k, v in entry.env_metrics.items()})
            # Episodes that ended early, per cause: one curve each on the run page, only when it happened.
            numbers.update({f"infra/{cause}": float(n) for cause, n in entry.infra_causes.items()})
            try:
                await self.tc.log_metrics_async(numbers, step=entry.policy_version)
            except Exception as exc:  # the dashboard's copy must never stop training
                log.warning("could not record step %d metrics with the run: %s", entry.step, exc)


async def run_grpo(training_client: TrainingClient, make_group: GroupBuilder, config: RLConfig, steps: int, *,
                   on_step: Callable[[StepLog], Any | Awaitable[Any]] | None = None) -> list[StepLog]:
    """Train ``training_client`` by GRPO for ``steps`` optimizer steps; returns every step's log.

    Args:
        training_client: the model to train (its current weights sample the first batch).
        make_group: ``make_group(index, n)`` returns the ``n`` environments of one group (see
            :data:`quilt.rl.GroupBuilder`).
        config: an :class:`RLConfig`.
        steps: optimizer steps to take (a step whose groups all have zero advantage takes none
            and still counts).
        on_step: called with each :class:`StepLog` as it is made (may be a coroutine function).

    Raises the first error that stops producing groups (a failing ``make_group``, a user error from
    the server); environment failures never raise, they are counted as ``infra_failure``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return await _Pipeline(training_client, make_group, config, steps, on_step).run()


def train_grpo(training_client: TrainingClient, make_group: GroupBuilder, config: RLConfig, steps: int, *,
               on_step: Callable[[StepLog], Any] | None = None) -> list[StepLog]:
    """Blocking form of :func:`run_grpo` (runs it in a fresh event loop)."""
    return asyncio.run(run_grpo(training_client, make_group, config, steps, on_step=on_step))


def summarize(logs: Sequence[StepLog], window: int = 3) -> dict[str, float]:
    """Mean reward over the first and last ``window`` steps, for examples' JSON lines."""
    if not logs:
        return {"reward_first": 0.0, "reward_last": 0.0}
    head, tail = logs[:window], logs[-window:]
    return {"reward_first": statistics.fmean(s.reward_mean for s in head),
            "reward_last": statistics.fmean(s.reward_mean for s in tail)}
