"""`quilt trainers list|drain|undrain`: the trainer shards of each base (QUILT_TRAINER_SHARDS above 1).

A drain is asked in Postgres (trainer_shards.draining); the shard itself moves its models, with
their stream entries, to the open shards between two rounds (batcher.shards), and gets no new ones
until undrained. The command waits until no model is placed on the shard, so a maintenance script
can stop it right after.
"""

from __future__ import annotations

import argparse
import re
import time

from core.errors import InvalidInput, NotFound

_SHARD = re.compile(r"shard-(0|[1-9][0-9]{0,3})")


def _base(conn, name: str | None) -> str:
    from bases import catalog

    trainable = [m.name for m in catalog.list_models_sync(conn) if m.trainable]
    if name is None:
        if len(trainable) != 1:
            raise InvalidInput(f"several bases are trained here; name one with --base: {trainable}", field="base")
        return trainable[0]
    if name not in trainable:
        raise NotFound(f"base {name!r} is not trained here; choose one of {trainable}", field="base")
    return name


def _shard(text: str) -> str:
    if not _SHARD.fullmatch(text):
        raise argparse.ArgumentTypeError(f"a shard is named shard-<i> (shard-0, shard-1, ...), got {text!r}")
    return text


def _stores(args):
    from core import db, redis_client
    from stack.launcher import prepare

    db_url, redis_url = prepare(args.data_dir)
    return db.connect(db_url), redis_client.sync_client(redis_url)


def cmd_list(args) -> int:
    import json

    from core.settings import get_core_settings
    from scaleout import placement

    shards = args.shards or get_core_settings().trainer_shards
    conn_cm, redis = _stores(args)
    with conn_cm as conn:
        base = _base(conn, args.base)
        views = placement.read_views(conn, redis, base, shards)
        beacons = redis.mget(placement.beacon_keys(base, shards))
    print(f"{base}: {shards} shard(s)")
    print(f"{'SHARD':<10} {'ALIVE':<6} {'DRAINING':<9} {'MODELS':>7} {'RESIDENT':>9} {'QUEUED':>7} {'RECENT TOKENS':>14}")
    for view, raw in zip(views, beacons, strict=True):
        beacon = json.loads(raw) if raw else {}
        print(f"{view.name:<10} {'yes' if view.alive else 'no':<6} {'yes' if view.draining else 'no':<9} "
              f"{view.models:>7} {beacon.get('models', '-'):>9} {beacon.get('queued', '-'):>7} "
              f"{int(view.recent_tokens):>14}")
    return 0


def cmd_drain(args) -> int:
    from scaleout import placement

    conn_cm, _ = _stores(args)
    with conn_cm as conn:
        conn.autocommit = True
        base = _base(conn, args.base)
        placement.set_draining(conn, base, args.shard, True)
        print(f"{args.shard} of {base} is draining: its models move to the other shards", flush=True)
        deadline = time.monotonic() + args.wait
        while (left := placement.models_on(conn, base, args.shard)) and time.monotonic() < deadline:
            time.sleep(0.5)
    if left:
        print(f"{len(left)} model(s) still on {args.shard} after {args.wait:g} s (is another shard running?)")
        return 1 if args.wait else 0
    print(f"{args.shard} holds no models; it may be stopped (`quilt trainers undrain {args.shard}` to reopen it)")
    return 0


def cmd_undrain(args) -> int:
    from scaleout import placement

    conn_cm, _ = _stores(args)
    with conn_cm as conn:
        base = _base(conn, args.base)
        placement.set_draining(conn, base, args.shard, False)
    print(f"{args.shard} of {base} takes new models again")
    return 0


def add_command(sub, data_dir_option) -> None:
    trainers = sub.add_parser("trainers", help="trainer shards: list, drain for maintenance, undrain") \
        .add_subparsers(dest="action", required=True)
    p = trainers.add_parser("list", help="each shard: alive, draining, models placed, resident, queued")
    data_dir_option(p)
    p.add_argument("--base", default=None, help="base model (default: the one trained here)")
    p.add_argument("--shards", type=int, default=0, help="how many shards (default: $QUILT_TRAINER_SHARDS)")
    p.set_defaults(func=cmd_list)
    for name, func, text in (("drain", cmd_drain, "move a shard's models to the others and place none there"),
                             ("undrain", cmd_undrain, "let a drained shard take new models again")):
        p = trainers.add_parser(name, help=text)
        data_dir_option(p)
        p.add_argument("shard", type=_shard, help="shard-<i>")
        p.add_argument("--base", default=None, help="base model (default: the one trained here)")
        if name == "drain":
            p.add_argument("--wait", type=float, default=300.0,
                           help="seconds to wait for the models to leave (0: ask and return)")
        p.set_defaults(func=func)
