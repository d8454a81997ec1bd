"""How many of a base's generation replicas and trainer shards are in service, when something
scales them while the platform runs (stack.k8s_scaler): one Redis record per base.

QUILT_GEN_REPLICAS and QUILT_TRAINER_SHARDS name the most workers a base may have (gen-0 ...,
shard-0 ...: their streams, beacons and consumer names). A scaler runs fewer and writes the count in
service here; every reader trims its names to it:

    router      sends no new group to a replica past the count (it is being removed, or not there)
    healthz     does not report a worker past the count as down, and shows it while it still beats
    ops page    counts the devices in service for the capacity planner

Without a record every named worker is in service, as before scaling existed. Trainer shards past
the count were drained (scaleout.placement) before the count was lowered, so no model is placed there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class InService:
    gen: int | None = None  # None: every named replica
    trainer: int | None = None
    drained: tuple[str, ...] = field(default=())  # trainer shards the scaler drained (it reopens only these)
    reason: str = ""  # why the scaler last moved (or held), for the operator page
    at: float = 0.0  # when it wrote this (wall time)

    def gen_names(self, names: list[str]) -> list[str]:
        return names if self.gen is None else names[:max(self.gen, 1)]

    def trainer_names(self, names: list[str]) -> list[str]:
        return names if self.trainer is None else names[:max(self.trainer, 1)]


def key(base_model: str) -> str:
    return f"quilt:scale:{base_model}"


def parse(raw: bytes | str | None) -> InService:
    """The record as written by `write`; a missing or unreadable one means every worker serves."""
    if not raw:
        return InService()
    try:
        data = json.loads(raw)
        gen, trainer = data.get("gen"), data.get("trainer")
        return InService(gen=int(gen) if gen is not None else None, trainer=int(trainer) if trainer is not None else None,
                         drained=tuple(str(s) for s in data.get("drained", ())), reason=str(data.get("reason", "")),
                         at=float(data.get("at", 0.0)))
    except (ValueError, TypeError, AttributeError):
        return InService()


def dumps(record: InService) -> str:
    return json.dumps({"gen": record.gen, "trainer": record.trainer, "drained": list(record.drained),
                       "reason": record.reason, "at": record.at})


def read(redis, base_model: str) -> InService:
    return parse(redis.get(key(base_model)))


async def read_async(redis, base_model: str) -> InService:
    return parse(await redis.get(key(base_model)))


def write(redis, base_model: str, record: InService) -> None:
    redis.set(key(base_model), dumps(record))
