"""`quilt up`: the embedded stack as child processes of one command.

Starts (or attaches to) Postgres and Redis under the data directory, applies migrations, makes sure
a base model exists, then runs the API, one trainer per trainable base model, one generation worker
per sampleable base model and a Celery worker with beat. A child that dies is restarted (with a
pause); Ctrl-C or SIGTERM stops them all, then the embedded servers. If the launcher itself dies
hard, its reaper stops them (`stack.leftovers`); two launchers never share a data directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

import migrations
from bases import catalog
from core import db, embedded, queue
from core.settings import clear_settings_cache, get_api_settings, get_core_settings, get_trainer_settings
from stack import leftovers, priority

log = logging.getLogger("quilt.launcher")

STATE_FILE = "stack.json"  # where a running stack tells tools its addresses
RESTART_PAUSE_S = 2.0
STOP_GRACE_S = 15.0


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = field(default=0.0)
    nice: int = 0  # stack.priority; workers get QUILT_WORKER_NICE

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab")
        # A new process group, so a Ctrl-C in the terminal reaches only the launcher, which then
        # stops children in order.
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        out.close()
        if self.nice:
            # Popen returns once the child has exec'd, well before Python starts a thread in it, so
            # its main thread's value is the one every later thread inherits.
            priority.set_nice(self.proc.pid, self.nice)
        self.started_at = time.monotonic()
        log.info("started %s (pid %d), log: %s", self.name, self.proc.pid, self.log_path)


def _use_data_dir(data_dir: Path | None) -> Path:
    if data_dir is not None:
        os.environ["QUILT_DATA_DIR"] = str(data_dir.resolve())
        clear_settings_cache()
    return get_core_settings().data_dir


def prepare(data_dir: Path | None = None) -> tuple[str, str]:
    """Point settings at the data directory, start/attach the embedded servers, migrate, ensure a
    base model. Returns (database_url, redis_url)."""
    _use_data_dir(data_dir)
    settings = get_core_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db_url = embedded.database_url(settings)
    migrations.apply_all(db_url)
    redis_url = embedded.redis_url(settings)
    with db.connect(db_url) as conn:
        models = catalog.list_models_sync(conn)
        if not models:
            ensure_tiny_model(conn)
        for base in models:
            if not base.config:  # written before the catalogue knew architectures (migration 0008)
                from bases import model_sources

                catalog.register(conn, model_sources.refreshed(base))
    return db_url, redis_url


def ensure_tiny_model(conn, *, architecture: str = "qwen3", sampleable: bool = True) -> catalog.BaseModel:
    """Build a tiny local random-weight base (idempotent) and add it to the catalogue: the Qwen3 one
    is the embedded default, the others exist for the architecture tests. `sampleable=False` adds it
    for training only: no generation worker, for a machine without a generation engine."""
    from bases import model_sources
    from billing.price_book import ensure_size_price
    from stack.tiny_model import TinyModelSpec, build_tiny_model, tiny_model_name

    name = tiny_model_name(architecture)
    info = build_tiny_model(get_core_settings().models_dir / name.split("/")[-1],
                            spec=TinyModelSpec(architecture=architecture))
    model = model_sources.describe(name, *model_sources.locate(path=info.path), renderer="chatml",
                                   sampleable=sampleable)
    catalog.register(conn, model)
    ensure_size_price(conn, model)
    return model


# Per-base settings in the catalogue (`quilt models add --device ...`) -> the workers' own settings.
_TRAINER_SERVING = {"device": "QUILT_TRAINER_DEVICE", "max_lora_rank": "QUILT_TRAINER_MAX_RANK",
                    "trainer_ranks": "QUILT_TRAINER_RANKS", "trainer_parallel": "QUILT_TRAINER_PARALLEL",
                    "expert_lora": "QUILT_TRAINER_EXPERT_LORA"}
_GEN_SERVING = {"gen_memory_share": "QUILT_GEN_GPU_MEMORY_SHARE", "max_lora_rank": "QUILT_GEN_MAX_LORA_RANK",
                "max_loras": "QUILT_GEN_MAX_LORAS", "tensor_parallel": "QUILT_GEN_TENSOR_PARALLEL",
                "pipeline_parallel": "QUILT_GEN_PIPELINE_PARALLEL", "expert_parallel": "QUILT_GEN_EXPERT_PARALLEL",
                "fully_sharded_loras": "QUILT_GEN_FULLY_SHARDED_LORAS", "expert_lora": "QUILT_GEN_EXPERT_LORA"}


def serving_env(base: catalog.BaseModel, env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of a base's trainer and generation worker: the launcher's, with the base's
    own settings (which win). Each worker resolves dtype 'auto' for its own device."""
    trainer = {**env, **{var: str(base.serving[k]) for k, var in _TRAINER_SERVING.items() if k in base.serving}}
    gen = {**env, **{var: str(base.serving[k]) for k, var in _GEN_SERVING.items() if k in base.serving}}
    if "gen_device" in base.serving:
        gen["CUDA_VISIBLE_DEVICES"] = str(base.serving["gen_device"])
    trainer["QUILT_TRAINER_DTYPE"] = gen["QUILT_GEN_DTYPE"] = base.dtype
    return trainer, gen


def trainer_command(py: str, ranks: int) -> list[str]:
    """The trainer's command: `python -m batcher.main`, or with `ranks` above 1 a gang of that many
    started by torch.distributed.run, which restarts all of them when one dies (batcher.engine.gang)."""
    if ranks == 1:
        return [py, "-m", "batcher.main"]
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "--max-restarts", str(get_trainer_settings().gang_restarts), "-m", "batcher.main"]


def _children(db_url: str, redis_url: str, host: str, port: int, api_replicas: int = 1,
              gen_replicas: int = 1, trainer_shards: int = 1, trainer_ranks: int = 1) -> list[Child]:
    settings = get_core_settings()
    logs = settings.data_dir / "logs"
    # Every process must agree on the replica and shard counts: the API routes into their streams.
    env = {**os.environ, "QUILT_DATABASE_URL": db_url, "QUILT_REDIS_URL": redis_url,
           "QUILT_DATA_DIR": str(settings.data_dir), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "QUILT_GEN_REPLICAS": str(gen_replicas), "QUILT_TRAINER_SHARDS": str(trainer_shards),
           "QUILT_TRAINER_RANKS": str(trainer_ranks)}
    py = sys.executable
    # API replicas share nothing but Postgres and Redis; replica i answers on port + i.
    children = [
        Child("api" if i == 0 else f"api-{i}",
              [py, "-m", "uvicorn", "--factory", "api.app:create_app", "--host", host, "--port", str(port + i),
               "--timeout-graceful-shutdown", "5", "--no-proxy-headers", "--workers", str(get_api_settings().workers)],
              env, logs / ("api.log" if i == 0 else f"api-{i}.log"))
        for i in range(api_replicas)
    ] + [
        Child("celery", [py, "-m", "celery", "-A", "stack.celery_worker", "worker", "-B", "--concurrency", "1",
                         "--loglevel", "INFO", "-s", str(settings.data_dir / "celerybeat-schedule")],
              env, logs / "celery.log"),
    ]
    with db.connect(db_url) as conn:
        models = catalog.list_models_sync(conn)
    for i, base in enumerate(models):
        trainer_env, gen_env = serving_env(base, env)
        trainer = trainer_command(py, int(trainer_env["QUILT_TRAINER_RANKS"]))  # the base's own gang size wins
        if base.trainable and trainer_shards == 1:
            children.append(Child(f"trainer:{base.name}", trainer,
                                  {**trainer_env, "QUILT_TRAINER_BASE_MODEL": base.name,
                                   "QUILT_TRAINER_CONSUMER_NAME": f"trainer-{i}"}, logs / f"trainer-{i}.log"))
        elif base.trainable:  # or shards, each holding the models placed on it (scaleout.placement)
            children += [Child(f"trainer:{base.name}@{name}", trainer,
                               {**trainer_env, "QUILT_TRAINER_BASE_MODEL": base.name,
                                "QUILT_TRAINER_CONSUMER_NAME": name}, logs / f"trainer-{i}-{name}.log")
                         for name in queue.shard_names(trainer_shards)]
        if base.sampleable and gen_replicas == 1:  # one generation worker (vLLM engine) per sampleable base
            children.append(Child(f"gen:{base.name}", [py, "-m", "gen_pool.worker"],
                                  {**gen_env, "QUILT_GEN_BASE_MODEL": base.name, "QUILT_GEN_CONSUMER_NAME": f"gen-{i}"},
                                  logs / f"gen-{i}.log"))
        elif base.sampleable:  # or replicas, named as the API routes to them
            children += [Child(f"gen:{base.name}@{name}", [py, "-m", "gen_pool.worker"],
                               {**gen_env, "QUILT_GEN_BASE_MODEL": base.name, "QUILT_GEN_CONSUMER_NAME": name},
                               logs / f"gen-{i}-{name}.log") for name in queue.replica_names(gen_replicas)]
    for child in children[api_replicas:]:  # the workers: their work is batch, the API's is waited on
        child.nice = settings.worker_nice
    return children


def _stop(children: list[Child]) -> None:
    for child in children:
        if child.proc and child.proc.poll() is None:
            child.proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", child.name, STOP_GRACE_S)
            child.proc.kill()  # the rest of its group goes next, its resource tracker last
            child.proc.wait()
        # A child's own children (vLLM's engine core) must not outlive it: end its process group.
        leftovers.end_group(child.proc.pid)


def up(*, data_dir: Path | None, host: str, port: int, api_replicas: int = 1, gen_replicas: int = 1,
       trainer_shards: int = 1, trainer_ranks: int = 1) -> int:
    """Run the embedded stack until interrupted; returns the exit code. `api_replicas` API
    processes answer on `port`, `port + 1`, ...; `gen_replicas` generation workers serve each
    sampleable base; `trainer_shards` trainer workers each trainable base, each a gang of
    `trainer_ranks` processes (batcher.engine.gang)."""
    stop_requested = False

    def _on_signal(signum, frame):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    directory = _use_data_dir(data_dir)
    leftovers.lock(directory)  # held until this process ends, however it ends
    stale = leftovers.stop_recorded(directory)  # a launcher (and its reaper) killed hard before us
    if stale:
        log.warning("stopped what a previous quilt up left running: %s", ", ".join(stale))
    reaper = subprocess.Popen([sys.executable, "-m", "stack.reaper", str(os.getpid()), str(directory)],
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db_url, redis_url = prepare(data_dir)
    children = _children(db_url, redis_url, host, port, api_replicas, gen_replicas, trainer_shards, trainer_ranks)
    _record(directory, [])
    for child in children:
        child.start()
    _record(directory, children)
    state_file = directory / STATE_FILE
    api_urls = [f"http://{host}:{port + i}" for i in range(api_replicas)]
    state_file.write_text(json.dumps({"pid": os.getpid(), "base_url": api_urls[0], "api_urls": api_urls,
                                      "database_url": db_url, "redis_url": redis_url}))
    print(f"Quilt is starting at http://{host}:{port} (data: {get_core_settings().data_dir}); Ctrl-C stops it",
          flush=True)
    servers = embedded.server_pids()
    try:
        while not stop_requested:
            time.sleep(0.2)
            now = embedded.server_pids()
            if now != servers:  # Redis or Postgres restarted under us: record the new pids
                servers = now
                try:
                    _record(directory, children)
                except Exception:  # bookkeeping must never take the stack down; the next change retries
                    log.exception("could not record the servers' new pids")
                    servers = []
            for child in children:
                assert child.proc is not None  # every child was started before this loop
                code = child.proc.poll()
                if code is None or stop_requested:
                    continue
                log.error("%s exited with %s; restarting (see %s)", child.name, code, child.log_path)
                leftovers.end_group(child.proc.pid)  # what it left behind (vLLM's engine core)
                time.sleep(RESTART_PAUSE_S)
                child.restarts += 1
                child.start()
                _record(directory, children)
    finally:
        log.info("stopping")
        stopping_since = time.monotonic()
        _stop(children)
        state_file.unlink(missing_ok=True)
        embedded.shutdown()
        # What is still running from the record goes too, and the record with it (the reaper then
        # has nothing to do): pgserver stops Postgres only when no process it counted is left, and
        # it never forgets one that was killed, so after a hard-killed launcher it would stay up.
        leftovers.stop_recorded(directory)
        reaper.terminate()
        log.info("stopped in %.1f s", time.monotonic() - stopping_since)
    print("Quilt stopped", flush=True)
    return 0


def _record(directory: Path, children: list[Child]) -> None:
    """What the reaper stops if this process dies without stopping them (stack.leftovers)."""
    entries = [leftovers.record_of(c.name, c.proc.pid, group=True) for c in children if c.proc]
    for name, pid, stop_signal in embedded.server_pids():
        # A pid file can outlive its server by a moment (it is restarting): the next change records it.
        with contextlib.suppress(psutil.NoSuchProcess):
            entries.append(leftovers.record_of(name, pid, group=False, stop_signal=stop_signal))
    leftovers.write(directory, entries)
