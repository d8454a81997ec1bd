"""The capacity planner over a run whose rollouts triple in length: trainer waiting and staleness,
planned split against a static one, at 8 to 1,000 accelerators.

A fluid model of one RL pipeline spread over DEVICES accelerators, split between generation and
training. Each batch is BATCH_PER_DEVICE x DEVICES rollouts of PROMPT prompt tokens and a mean
length that grows from LEN0 to 3 x LEN0 over the horizon (as reported for long RL runs).
Generating a batch costs batch x length / GEN_RATE device-seconds; training it costs
batch x (prompt + length) / TRAIN_RATE. Generation may run at most STALENESS batches ahead of the
trainer (quilt.rl's max_staleness); a batch's staleness is the trainer's steps taken while it was
generated. Moving a device between sides idles it for MOVE_S (loading the other side's weights).

  static:  the split that balances the two sides at the start, held for the whole run;
  planned: the same start; every PLAN_EVERY_S scaleout.capacity_plan.recommend (imported, not copied)
           reads the window's queue health (each side's busy fraction, staleness) and the split
           moves to its answer.

Printed per scale: trainer waiting (share of trainer device time idle for want of a batch),
staleness mean/max, batches per hour, the final split. Ends with one JSON line per scale.

    python bench/capacity_sim.py [--devices 8,64,256,1000] [--staleness 1] ...

Which regime favours planning: any run whose balance drifts (here generation's share of the
work grows from 50% to 60%); a run whose lengths stay put gains nothing and pays MOVE_S per
move, which the dead band keeps rare.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
from dataclasses import dataclass

from flags import add_flags, from_flags

from scaleout.capacity_plan import PlannerSettings, QueueHealth, recommend


@dataclass(frozen=True)
class Run:
    devices: int = 8
    batch_per_device: int = 16
    prompt: float = 256.0
    len0: float = 256.0
    growth: float = 3.0  # the mean length at the end over the start
    gen_rate: float = 2000.0  # rollout tokens/s one generation device decodes
    train_rate: float = 4000.0  # tokens/s one trainer device trains
    staleness: int = 1
    horizon_s: float = 6 * 3600.0
    plan_every_s: float = 300.0
    move_s: float = 60.0
    dt: float = 1.0


def length(r: Run, t: float) -> float:
    return r.len0 * (1 + (r.growth - 1) * min(t / r.horizon_s, 1.0))


def balanced_split(r: Run, t: float) -> int:
    """Generation devices that balance the two sides' work at time t (rounded, at least 1 each)."""
    gen_work = length(r, t) / r.gen_rate
    train_work = (r.prompt + length(r, t)) / r.train_rate
    return min(max(1, round(r.devices * gen_work / (gen_work + train_work))), r.devices - 1)


def simulate(r: Run, planned: bool) -> dict:
    gen = balanced_split(r, 0.0)
    moving: list[tuple[float, str]] = []  # (ready at, side) devices on their way
    batch = r.batch_per_device * r.devices
    generated = trained = 0  # batches
    gen_progress = train_progress = 0.0  # fraction of the batch in hand
    sampled_at: list[int] = []  # per generated batch not yet trained: the trainer's steps when it began
    began_at = 0  # steps when the batch being generated began
    training = False
    staleness: list[int] = []
    window = {"gen_used": 0.0, "gen_avail": 0.0, "train_used": 0.0, "train_avail": 0.0}
    train_used = train_avail = 0.0
    last_plan, moves, t = 0.0, 0, 0.0
    while t < r.horizon_s:
        moving = [(at, side) for at, side in moving if at > t]  # those arrived take part from now
        in_gen = gen - sum(1 for _, side in moving if side == "gen")
        in_train = (r.devices - gen) - sum(1 for _, side in moving if side == "train")
        L = length(r, t)
        # Generation, unless as far ahead as the bound allows.
        if generated - trained < r.staleness + 1:
            if gen_progress == 0.0:
                began_at = trained
            gen_progress += in_gen * r.dt / (batch * L / r.gen_rate)
            window["gen_used"] += in_gen * r.dt
            if gen_progress >= 1.0:
                generated, gen_progress = generated + 1, 0.0
                sampled_at.append(began_at)
        window["gen_avail"] += in_gen * r.dt
        # Training, if a batch is there.
        if not training and sampled_at:
            staleness.append(trained - sampled_at.pop(0))
            training = True
        if training:
            train_progress += in_train * r.dt / (batch * (r.prompt + L) / r.train_rate)
            window["train_used"] += in_train * r.dt
            train_used += in_train * r.dt
            if train_progress >= 1.0:
                trained, train_progress, training = trained + 1, 0.0, False
        window["train_avail"] += in_train * r.dt
        train_avail += in_train * r.dt
        t += r.dt
        if planned and t - last_plan >= r.plan_every_s:
            recent = staleness[-8:]
            health = QueueHealth(gen_devices=gen, train_devices=r.devices - gen,
                                 gen_busy=window["gen_used"] / max(window["gen_avail"], 1e-9),
                                 trainer_busy=window["train_used"] / max(window["train_avail"], 1e-9),
                                 staleness_mean=sum(recent) / len(recent) if recent else 0.0,
                                 staleness_bound=r.staleness)
            rec = recommend(health, PlannerSettings())
            if rec.changes:
                side = "gen" if rec.gen_devices > gen else "train"
                moving += [(t + r.move_s, side)] * abs(rec.gen_devices - gen)
                moves += abs(rec.gen_devices - gen)
                gen = rec.gen_devices
            window = dict.fromkeys(window, 0.0)
            last_plan = t
    return {"trainer_waiting": 1 - train_used / train_avail, "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness), "batches_per_h": trained / (r.horizon_s / 3600),
            "final_gen": gen, "final_train": r.devices - gen, "moves": moves,
            "balanced_end": balanced_split(r, r.horizon_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="8,64,256,1000")
    add_flags(ap, Run, skip=("devices",))
    args = ap.parse_args()
    print(f"rollout length {args.len0:.0f} -> {args.len0 * args.growth:.0f} tokens over {args.horizon_s / 3600:.1f} h; "
          f"staleness bound {args.staleness}; planner every {args.plan_every_s:.0f} s; a move idles a device "
          f"{args.move_s:.0f} s\n")
    print(f"{'devices':>8}{'policy':>9}{'trainer waiting':>17}{'staleness mean/max':>20}{'batches/h':>11}"
          f"{'final gen/train':>17}{'moves':>7}{'balanced at end':>17}")
    lines = []
    for n in (int(x) for x in args.devices.split(",")):
        r = from_flags(args, Run, skip=("devices",), devices=n)
        out = {p: simulate(r, p == "planned") for p in ("static", "planned")}
        for name, o in out.items():
            print(f"{n:>8}{name:>9}{o['trainer_waiting']:>16.1%}{o['staleness_mean']:>14.2f}/{o['staleness_max']:<5}"
                  f"{o['batches_per_h']:>11.1f}{o['final_gen']:>10}/{o['final_train']:<6}{o['moves']:>7}"
                  f"{o['balanced_end']:>12}/{n - o['balanced_end']}")
        lines.append({"devices": n, **{f"{p}_{k}": round(v, 4) if isinstance(v, float) else v
                                       for p, o in out.items() for k, v in o.items()
                                       if k in ("trainer_waiting", "staleness_max", "batches_per_h")},
                      "planned_over_static_batches": round(out["planned"]["batches_per_h"] /
                                                           out["static"]["batches_per_h"], 3)})
    print()
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
