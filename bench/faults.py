"""Fault injection on the embedded stack: tenants keep training and sampling while processes are
killed and stores restarted at random moments; nothing acknowledged may be lost.

    .venv/bin/python bench/faults.py              # the full run (about an hour here)
    .venv/bin/python bench/faults.py --quick      # one of each fault (minutes)

Four tenants (two on the Quilt SDK, two on the official tinker SDK) each loop forward_backward ->
optim_step -> sample from the base model, counting the optimizer steps they were told succeeded.
Meanwhile faults are injected, in an order and at moments drawn from `--seed`: SIGKILL of the
trainer, the generation worker, Celery and the API (the launcher restarts each), and Redis
(SHUTDOWN, then started again from its configuration) and Postgres (pg_ctl fast stop, then start)
stopped for a few seconds. After each fault the harness waits until healthz is 200 again and a
killed process runs again under a new pid (its own beacon, for the trainer and the generation
worker): that wait is the recovery time. At the end every tenant saves its state, and the checkpoint's AdamW
step count is compared with the steps it was acknowledged (a lost step, or one applied twice,
shows); every finished request must have exactly one ledger row and every failed one none.

Prints a table (fault, times injected, requests affected, requests failed, acknowledged steps lost,
ledger rows wrong, max recovery), and how many of the killed generation workers' `/dev/shm` segments
are still there after the stack stops; ends with one JSON line.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import torch

from core import embedded, health, redis_client
from stack import leftovers
from stack.ephemeral import TINY, RunningStack, ephemeral_stack, new_tenant

FULL = {"trainer": 20, "gen": 10, "celery": 5, "redis": 3, "postgres": 3, "api": 5}
QUICK = {"trainer": 2, "gen": 1, "celery": 1, "redis": 1, "postgres": 1, "api": 1}
OUTAGE_S = 3.0
RECOVERY_LIMIT_S = 600.0  # a stack that is not back by then has failed the run


# ----------------------------------------------------------------------------------- faults

PROCESS = {"trainer": f"trainer:{TINY}", "gen": f"gen:{TINY}", "celery": "celery", "api": "api"}
BEACON = {"trainer": health.trainer_key(TINY), "gen": health.gen_key(TINY)}  # beacons that carry their pid
SEGMENTS: set[str] = set()  # /dev/shm segments of killed generation workers' engines


def inject(stack: RunningStack, fault: str) -> int | None:
    """Inject `fault`; returns the pid killed (None for a store restart)."""
    if fault == "redis":
        embedded.restart_redis(stack.redis_url, OUTAGE_S)
        return None
    if fault == "postgres":
        embedded.restart_postgres(stack.data_dir, OUTAGE_S)
        return None
    if fault == "gen":  # what its engine's processes map must be unlinked after the kill
        SEGMENTS.update(leftovers.shared_memory_of(leftovers.pid_of(stack.data_dir, PROCESS[fault])))
    return leftovers.kill_hard(stack.data_dir, PROCESS[fault])


def recovered(stack: RunningStack, fault: str, killed: int | None) -> bool:
    """healthz is 200 and, after a kill, the launcher has restarted the process and (for the
    workers) the new one beats: a stale beacon of the dead one does not count."""
    try:
        r = httpx.get(stack.base_url + "/api/v1/healthz", timeout=5)
    except httpx.HTTPError:
        return False
    if r.status_code != 200:
        return False
    if killed is None:
        return True
    try:
        now = leftovers.pid_of(stack.data_dir, PROCESS[fault])
    except LookupError:  # between the kill and the restart's record
        return False
    if now == killed:
        return False
    if fault not in BEACON:
        return True
    raw = redis_client.sync_client(stack.redis_url).get(BEACON[fault])  # healthz says up/down only
    return raw is not None and json.loads(raw).get("pid") == now


# ----------------------------------------------------------------------------------- tenants

class Tenant(threading.Thread):
    """One tenant's training-and-sampling loop until `stop` is set."""

    def __init__(self, stack: RunningStack, index: int, stop: threading.Event):
        super().__init__(daemon=True, name=f"tenant-{index}")
        self.stack, self.index, self.stop = stack, index, stop
        self.sdk = "quilt" if index % 2 == 0 else "tinker"
        self.tenant_id, self.key = new_tenant(stack, f"faults-{index}")
        self.acknowledged_steps = 0
        self.calls: list[tuple[float, float]] = []  # (started, ended) of every call
        self.failures: list[tuple[float, str]] = []  # (when, what)
        self.model_id: str | None = None
        self.saved_path: str | None = None

    def run(self) -> None:
        try:
            (self._quilt if self.sdk == "quilt" else self._tinker)()
        except Exception as exc:  # counted, never raised out of the thread
            self.failures.append((time.monotonic(), f"{type(exc).__name__}: {exc}"))

    def _tokens(self, step: int) -> list[int]:
        return [5 + self.index, 6, 7, 8 + step % 50, 9]

    def _call(self, what: str, fn):
        started = time.monotonic()
        try:
            return fn()
        except Exception as exc:
            self.failures.append((time.monotonic(), f"{what}: {type(exc).__name__}: {exc}"))
            return None
        finally:
            self.calls.append((started, time.monotonic()))

    def _quilt(self) -> None:
        import quilt

        with quilt.Client(api_key=self.key, base_url=self.stack.base_url) as client:
            tc = client.create_training_client(TINY, rank=4, seed=self.index)
            self.model_id = tc.model_id
            sampler = client.create_sampling_client(base_model=TINY)
            step = 0
            while not self.stop.is_set():
                fb = self._call("forward_backward", lambda: tc.forward_backward(
                    [quilt.datum_for_next_token(self._tokens(step))], "cross_entropy").result(timeout=900))
                if fb is None:
                    continue
                if self._call("optim_step", lambda: tc.optim_step(quilt.AdamParams(learning_rate=1e-3))
                              .result(timeout=900)) is not None:
                    self.acknowledged_steps += 1
                self._call("sample", lambda: sampler.sample([5, 6, 7], 2, quilt.SamplingParams(
                    max_tokens=8, seed=step, stop=[])).result(timeout=900))
                step += 1
            self.saved_path = self._call("save_state", lambda: tc.save_state("faults-end").result(timeout=900))

    def _tinker(self) -> None:
        import tinker
        from tinker import types

        with tinker.ServiceClient(base_url=self.stack.base_url, api_key=self.key) as service:
            tc = service.create_lora_training_client(base_model=TINY, rank=4).result()
            self.model_id = tc.model_id
            sampler = service.create_sampling_client(base_model=TINY).result()
            step = 0
            while not self.stop.is_set():
                tokens = self._tokens(step)
                datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
                if self._call("forward_backward", lambda: tc.forward_backward([datum], "cross_entropy").result()) \
                        is None:
                    continue
                if self._call("optim_step", lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()) \
                        is not None:
                    self.acknowledged_steps += 1
                self._call("sample", lambda: sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                                                            types.SamplingParams(max_tokens=8, seed=step,
                                                                                 stop=[])).result())
                step += 1
            saved = self._call("save_state", lambda: tc.save_state("faults-end").result())
            self.saved_path = saved.path if saved is not None else None


# ----------------------------------------------------------------------------------- checks

def steps_applied(stack: RunningStack, model_id: str) -> int | None:
    """AdamW's step count in the model's last saved training checkpoint."""
    from checkpoints.layout import OPTIMIZER_FILE
    from core import db

    with db.connect(stack.database_url) as conn:
        row = conn.execute("SELECT storage_path FROM checkpoints WHERE model_id = %s AND name = 'faults-end' "
                           "ORDER BY created_at DESC LIMIT 1", (model_id,)).fetchone()
    if row is None:
        return None
    state = torch.load(Path(row["storage_path"]) / OPTIMIZER_FILE, weights_only=True)["state"]
    steps = {int(s["step"]) for s in state.values()}
    return steps.pop() if len(steps) == 1 else -1


def ledger_mismatches(stack: RunningStack, tenant_ids: list[str]) -> int:
    """Requests of these tenants whose ledger rows are not exactly one if done, none if failed
    (one still queued or running 60 s after the loops stopped counts too)."""
    from core import db

    with db.connect(stack.database_url) as conn:
        deadline = time.monotonic() + 60  # results are answered a moment before their rows commit
        while time.monotonic() < deadline and conn.execute(
                "SELECT count(*) AS n FROM requests WHERE tenant_id = ANY(%s) AND status IN ('queued', 'running')",
                (tenant_ids,)).fetchone()["n"]:
            time.sleep(0.2)
        return conn.execute(
            "SELECT count(*) AS n FROM requests r WHERE r.tenant_id = ANY(%s) AND "
            "(SELECT count(*) FROM usage_ledger u WHERE u.request_id = r.id) <> "
            "(CASE WHEN r.status = 'done' THEN 1 WHEN r.status = 'failed' THEN 0 ELSE -1 END)",
            (tenant_ids,)).fetchone()["n"]


# ----------------------------------------------------------------------------------- run

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--quick", action="store_true", help="one of each fault (two trainer kills)")
    parser.add_argument("--gap-s", type=float, nargs=2, default=(2.0, 8.0), help="pause between faults, drawn")
    args = parser.parse_args()
    counts = QUICK if args.quick else FULL
    rng = random.Random(args.seed)
    plan = [fault for fault, n in counts.items() for _ in range(n)]
    rng.shuffle(plan)

    stop = threading.Event()
    injected: Counter[str] = Counter()
    recovery: dict[str, float] = {}
    windows: list[tuple[str, float, float]] = []  # fault, injected at, recovered at
    with ephemeral_stack() as stack:
        tenants = [Tenant(stack, i, stop) for i in range(4)]
        for t in tenants:
            t.start()
        time.sleep(10)  # the loops are running
        for n, fault in enumerate(plan, 1):
            time.sleep(rng.uniform(*args.gap_s))
            at = time.monotonic()
            killed = inject(stack, fault)
            while not recovered(stack, fault, killed):
                if time.monotonic() - at > RECOVERY_LIMIT_S:
                    stop.set()
                    raise SystemExit(f"{fault}: no recovery in {RECOVERY_LIMIT_S:.0f} s\n"
                                     f"{(stack.data_dir / 'up.out').read_text()[-3000:]}")
                time.sleep(0.2)
            back = time.monotonic()
            injected[fault] += 1
            recovery[fault] = max(recovery.get(fault, 0.0), back - at)
            windows.append((fault, at, back))
            print(f"[{n}/{len(plan)}] {fault:<9} recovered in {back - at:6.1f} s", flush=True)
        time.sleep(10)
        stop.set()
        for t in tenants:
            t.join(timeout=1800)
        lost_steps = 0
        for t in tenants:
            applied = steps_applied(stack, t.model_id) if t.model_id else None
            if applied is None or applied != t.acknowledged_steps:
                lost_steps += abs((applied or 0) - t.acknowledged_steps)
            print(f"tenant {t.index} ({t.sdk}): {len(t.calls)} calls, {len(t.failures)} failed, "
                  f"{t.acknowledged_steps} steps acknowledged, {applied} in the final checkpoint")
            for _when, what in t.failures[:5]:
                print(f"    failed: {what[:200]}")
        mismatches = ledger_mismatches(stack, [t.tenant_id for t in tenants])

    leaked = sorted(path for path in SEGMENTS if Path(path).exists())
    failures = [(when, what) for t in tenants for when, what in t.failures]
    calls = [c for t in tenants for c in t.calls]

    def affected(fault: str) -> int:  # calls in flight while the fault lasted
        return sum(1 for start, end in calls if any(w[0] == fault and start <= w[2] and end >= w[1] for w in windows))

    def failed(fault: str) -> int:  # failures from the fault to 30 s after recovery
        return sum(1 for when, _ in failures if any(w[0] == fault and w[1] <= when <= w[2] + 30 for w in windows))

    print(f"\n{'fault':<10}{'injected':>9}{'affected':>10}{'failed':>8}{'max recovery s':>16}")
    for fault in counts:
        print(f"{fault:<10}{injected[fault]:>9}{affected(fault):>10}{failed(fault):>8}"
              f"{recovery.get(fault, 0.0):>16.1f}")
    print(f"\nrequests failed {len(failures)}, acknowledged steps lost {lost_steps}, ledger rows wrong {mismatches}, "
          f"killed engines' shared memory segments left {len(leaked)} of {len(SEGMENTS)}")
    print(json.dumps({"faults": sum(injected.values()), "acknowledged_steps_lost": lost_steps,
                      "requests_failed": len(failures), "ledger_mismatches": mismatches,
                      "max_recovery_s": round(max(recovery.values(), default=0.0), 1),
                      "shared_memory_left": len(leaked),
                      "by_fault": {f: {"injected": injected[f], "max_recovery_s": round(recovery.get(f, 0.0), 1)}
                                   for f in counts}}))


if __name__ == "__main__":
    main()
