"""The Celery app for independent background jobs: upkeep, and billing (Stripe customers and sync).

`celery -A core.celery_app worker -B`. The broker address is read when Celery first configures
itself, not at import, so importing this module starts nothing.
"""

from __future__ import annotations

from celery import Celery
from celery.schedules import crontab

from core import embedded, redis_client

app = Celery("quilt", include=["core.upkeep", "billing.tasks"])


@app.on_configure.connect
def _configure(sender: Celery, **_) -> None:
    url = embedded.celery_url(redis_client.resolve_url())
    sender.conf.update(
        broker_url=url,
        result_backend=url,
        task_acks_late=True,  # a task killed mid-run is redelivered, not lost
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        beat_schedule={
            "heartbeat": {"task": "quilt.upkeep.heartbeat", "schedule": 10.0},
            "expire-sessions": {"task": "quilt.upkeep.expire_sessions", "schedule": 60.0},
            "sweep-checkpoints": {"task": "quilt.upkeep.sweep_checkpoints", "schedule": 60.0},
            "sweep-orphan-checkpoints": {"task": "quilt.upkeep.sweep_orphan_checkpoints",
                                         "schedule": crontab(minute="35")},
            # Hourly, after the previous hour's window has settled (QUILT_BILLING_SETTLE_S, 5 min).
            "billing-stripe-sync": {"task": "quilt.billing.sync_stripe", "schedule": crontab(minute="10")},
            "billing-stripe-customers": {"task": "quilt.billing.ensure_customers", "schedule": 900.0},
        },
    )
