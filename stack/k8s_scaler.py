"""The capacity planner acting on Kubernetes (QUILT_SCALER_ACT=true; off by default): a Celery beat
task that, every QUILT_SCALER_INTERVAL_S, reads the planner's answer for one base (the operator
page's reading, api.dashboard.ops.planner_health), turns it into replica counts and the moves that reach
them (scaleout.moves), and carries them out:

    1. drains the trainer shards that are to leave, reopens the ones taken back (Postgres);
    2. writes the counts in service (scaleout.in_service) so routers and health follow at once;
    3. patches the `scale` subresource of the generation and trainer StatefulSets.

Everything it decides is in step 2's record and in its log line; the Kubernetes calls go through
the official client (in-cluster service account, or QUILT_SCALER_API_SERVER and _API_TOKEN).
deploy/k8s/base/scaler.yaml grants the Celery pods `get` and `patch` on statefulsets/scale only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from bases import catalog
from core import db, redis_client
from core.celery_app import app
from core.errors import InvalidInput
from core.settings import ScalerSettings, get_core_settings, get_scaler_settings
from scaleout import capacity_plan, in_service, moves, placement

log = logging.getLogger("quilt.scaler")

_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class StatefulSets:
    """The replicas of StatefulSets in one namespace, through their `scale` subresource."""

    def __init__(self, settings: ScalerSettings):
        from kubernetes import client, config

        if settings.api_server:
            cfg = client.Configuration()
            cfg.host = settings.api_server
            token = settings.api_token.get_secret_value()
            if token:
                cfg.api_key = {"BearerToken": token}
                cfg.api_key_prefix = {"BearerToken": "Bearer"}
            self.apps = client.AppsV1Api(client.ApiClient(cfg))
        else:
            config.load_incluster_config()
            self.apps = client.AppsV1Api()
        self.namespace = settings.namespace or _NAMESPACE_FILE.read_text().strip()

    def replicas(self, name: str) -> int:
        return int(self.apps.read_namespaced_stateful_set_scale(name, self.namespace).spec.replicas or 0)

    def set_replicas(self, name: str, replicas: int) -> None:
        # Named: for a dict body the client would pick the first type it lists, a JSON patch,
        # which the API server refuses for an object.
        self.apps.patch_namespaced_stateful_set_scale(name, self.namespace, {"spec": {"replicas": replicas}},
                                                      _content_type="application/merge-patch+json")


def scaled_base(conn, settings: ScalerSettings) -> catalog.BaseModel:
    """The base the scaler acts on: the named one, or the only base both trained and sampled here."""
    both = [m for m in catalog.list_models_sync(conn) if m.trainable and m.sampleable]
    if settings.base_model:
        match = [m for m in both if m.name == settings.base_model]
        if not match:
            raise InvalidInput(f"QUILT_SCALER_BASE_MODEL {settings.base_model!r} is not both trained and sampled "
                               f"here; choose one of {[m.name for m in both]}", field="QUILT_SCALER_BASE_MODEL")
        return match[0]
    if len(both) != 1:
        raise InvalidInput(f"{len(both)} bases are both trained and sampled here; name one with "
                           "QUILT_SCALER_BASE_MODEL", field="QUILT_SCALER_BASE_MODEL")
    return both[0]


async def _health(db_url: str, redis_url: str, base: catalog.BaseModel, window_s: float,
                  devices: tuple[int, int]) -> capacity_plan.QueueHealth | None:
    from api.dashboard import ops

    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True, row_factory=dict_row) as conn:
        redis = redis_client.async_client(redis_url)
        try:
            return await ops.planner_health(conn, redis, base, window_s=window_s, devices=devices)
        finally:
            await redis.aclose()


def fleet_of(cluster: StatefulSets, settings: ScalerSettings) -> moves.Fleet:
    """The base's workers as the cluster runs them now, within the named ones."""
    core = get_core_settings()
    return moves.Fleet(gen=cluster.replicas(settings.gen_statefulset),
                       trainer=cluster.replicas(settings.trainer_statefulset),
                       gen_max=core.gen_replicas, trainer_max=core.trainer_shards,
                       devices_per_gen=settings.devices_per_gen_replica,
                       devices_per_trainer=settings.devices_per_trainer_shard)


def act(conn, redis, cluster: StatefulSets, settings: ScalerSettings, base: str, fleet: moves.Fleet,
        rec: capacity_plan.Recommendation) -> moves.Step:
    """Carry out the next move toward `rec` (steps 1-3 of the module docstring)."""
    views = placement.read_views(conn, redis, base, fleet.trainer_max) if fleet.trainer_max > 1 else []
    step = moves.step(rec, fleet, {v.name: v for v in views}, in_service.read(redis, base))
    for shard in step.drain:
        placement.set_draining(conn, base, shard, True)
    for shard in step.reopen:
        placement.set_draining(conn, base, shard, False)
    # The record first: a replica about to go gets no new group from here on.
    in_service.write(redis, base, dataclasses.replace(step.record, reason=step.reason, at=time.time()))
    # The side that shrinks first, so the other's new pods find their accelerators free.
    resizes = [(settings.gen_statefulset, fleet.gen, step.gen), (settings.trainer_statefulset, fleet.trainer, step.trainer)]
    for name, now, then in sorted(resizes, key=lambda m: m[2] - m[1]):
        if then != now:
            cluster.set_replicas(name, then)
    if step.changes(fleet):
        log.info("scaler %s: generation %d -> %d, trainer %d -> %d, drain %s, reopen %s (%s)", base, fleet.gen,
                 step.gen, fleet.trainer, step.trainer, list(step.drain), list(step.reopen), step.reason)
    return step


def tick(conn, redis, cluster: StatefulSets, settings: ScalerSettings, *, db_url: str, redis_url: str) -> dict:
    """One look and one move (see the module docstring); returns what it saw and did."""
    base = scaled_base(conn, settings)
    fleet = fleet_of(cluster, settings)
    health = asyncio.run(_health(db_url, redis_url, base, settings.window_s, fleet.devices))
    if health is None:
        return {"base": base.name, "fleet": dataclasses.asdict(fleet), "action": "no reading yet"}
    rec = capacity_plan.recommend(health)
    step = act(conn, redis, cluster, settings, base.name, fleet, rec)
    return {"base": base.name, "fleet": dataclasses.asdict(fleet), "recommended": [rec.gen_devices, rec.train_devices],
            "gen": step.gen, "trainer": step.trainer, "drain": list(step.drain), "reopen": list(step.reopen),
            "reason": step.reason}


@app.task(name="quilt.scaler.tick")
def tick_task() -> dict:
    """Celery beat's entry: nothing unless QUILT_SCALER_ACT is on."""
    settings = get_scaler_settings()
    if not settings.act:
        return {"action": "off"}
    db_url, redis_url = db.resolve_url(), redis_client.resolve_url()
    with db.connect(db_url) as conn:
        conn.autocommit = True
        return tick(conn, redis_client.sync_client(redis_url), StatefulSets(settings), settings,
                    db_url=db_url, redis_url=redis_url)
