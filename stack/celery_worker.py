"""The Celery worker and beat: `celery -A stack.celery_worker worker -B`.

The entry point names the task modules (importing them registers their tasks on `core.celery_app`)
and the beat schedule.
"""

from __future__ import annotations

from celery.schedules import crontab

import billing.tasks  # noqa: F401  (registers quilt.billing.*)
import stack.k8s_scaler  # noqa: F401  (registers quilt.scaler.*)
import stack.upkeep  # noqa: F401  (registers quilt.upkeep.*)
from core.celery_app import app
from core.settings import get_scaler_settings

app.conf.beat_schedule = {
    "heartbeat": {"task": "quilt.upkeep.heartbeat", "schedule": 10.0},
    "expire-sessions": {"task": "quilt.upkeep.expire_sessions", "schedule": 60.0},
    "sweep-checkpoints": {"task": "quilt.upkeep.sweep_checkpoints", "schedule": 60.0},
    "prune-records": {"task": "quilt.upkeep.prune_records", "schedule": 60.0},
    "fail-never-enqueued": {"task": "quilt.upkeep.fail_never_enqueued", "schedule": 60.0},
    "sweep-orphan-checkpoints": {"task": "quilt.upkeep.sweep_orphan_checkpoints", "schedule": crontab(minute="35")},
    # Hourly, after the previous hour's window has settled (QUILT_BILLING_SETTLE_S, 5 min).
    "billing-stripe-sync": {"task": "quilt.billing.sync_stripe", "schedule": crontab(minute="10")},
    # Hourly, just after each hour ends: its checkpoint storage onto the ledger (once per hour).
    "billing-accrue-storage": {"task": "quilt.billing.accrue_storage", "schedule": crontab(minute="2")},
    "billing-stripe-customers": {"task": "quilt.billing.ensure_customers", "schedule": 900.0},
    "billing-suspend-overdue": {"task": "quilt.billing.suspend_overdue", "schedule": 300.0},
    # Returns at once unless QUILT_SCALER_ACT is on.
    "scaler-tick": {"task": "quilt.scaler.tick", "schedule": get_scaler_settings().interval_s},
}

__all__ = ["app"]
