"""Container probes for the workers, which serve no HTTP: `python -m stack.probe trainer|gen`.

Exit 0 when this process's worker is alive by the same sign the platform itself trusts: its stream
consumer's liveness key in Redis (core.health.consumer_key), which the worker's loop refreshes and
which, once it lapses, lets other workers take its pending requests. The worker is named by the
same settings it runs with (QUILT_TRAINER_BASE_MODEL / QUILT_TRAINER_CONSUMER_NAME, or the QUILT_GEN_
pair), so the probe checks exactly the consumer of its own pod. Exit 1 with the reason otherwise.
A worker still starting (loading its base, starting vLLM) has no key yet: give the probe an initial
delay or a startup probe long enough for that.
"""

from __future__ import annotations

import sys

from core import health, queue, redis_client, stores
from core.settings import get_core_settings, get_trainer_settings


def _consumer(kind: str) -> tuple[str, str]:
    if kind == "trainer":
        s, shards = get_trainer_settings(), get_core_settings().trainer_shards
        if shards <= 1:
            return queue.train_stream(s.base_model), s.consumer_name
        shard = queue.shard_of(s.consumer_name, shards)
        return queue.train_stream(s.base_model, shard), shard
    from core.settings import get_gen_pool_settings

    g, replicas = get_gen_pool_settings(), get_core_settings().gen_replicas
    if replicas <= 1:
        return queue.sample_stream(g.base_model), g.consumer_name
    replica = queue.replica_of(g.consumer_name, replicas)  # the worker's own name for itself
    return queue.sample_stream(g.base_model, replica), replica


def check(kind: str) -> tuple[bool, str]:
    try:
        stream, consumer = _consumer(kind)
    except ValueError as exc:  # a generation pod whose name is no replica's: it never beats either
        return False, str(exc)
    try:
        alive = bool(redis_client.sync_client().exists(health.consumer_key(stream, consumer)))
    except stores.STORE_ERRORS as exc:
        # Redis down is not this worker's fault: restarting it would not help, so it counts as alive.
        return True, f"redis unreachable ({exc}); not judging {consumer}"
    return alive, f"{kind} {consumer} on {stream}: {'alive' if alive else 'no liveness key'}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in ("trainer", "gen"):
        print("usage: python -m stack.probe trainer|gen", file=sys.stderr)
        return 2
    ok, why = check(args[0])
    print(why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
