"""The Celery app for independent background jobs. Task modules register on it (`@app.task`);
which modules a worker loads and what beat runs are the entry point's (`stack.celery_worker`), so
this shared module names no feature package. Tasks are sent by name (`app.send_task`).

The broker address is read when Celery first configures itself, not at import, so importing this
module starts nothing.
"""

from __future__ import annotations

from celery import Celery

from core import embedded, redis_client

app = Celery("quilt")


@app.on_configure.connect  # type: ignore[untyped-decorator]  # celery ships no type information
def _configure(sender: Celery, **_: object) -> None:
    url = embedded.celery_url(redis_client.resolve_url())
    sender.conf.update(
        broker_url=url,
        result_backend=url,
        # Nothing in Quilt reads a task's result after it ends (tests read theirs at once): an hour,
        # not Celery's day, of beat's dozen results a minute in Redis.
        result_expires=3600,
        task_acks_late=True,  # a task killed mid-run is redelivered, not lost
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )
