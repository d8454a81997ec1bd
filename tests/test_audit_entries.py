"""The audit log as tinker's AuditLogEntry (api.routes.admin.audit_entry): a table of rows."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from api.routes.admin import audit_entry

AT = datetime(2026, 5, 1, tzinfo=UTC)
PATH = "tinker://sess-1:train:0/weights/step-3"


@pytest.mark.parametrize(("action", "detail", "path", "model_id"), [
    ("checkpoint.token_created", {"token_id": "t1", "tinker_path": PATH}, PATH, "sess-1:train:0"),
    ("checkpoint.token_used", {"tinker_path": PATH, "by_tenant": "b"}, PATH, "sess-1:train:0"),
    ("checkpoint.copied", {"source": PATH, "copy": "tinker://sess-2:train:0/weights/step-3"}, PATH, "sess-1:train:0"),
    # Not a checkpoint event, or no well-formed path: no top-level checkpoint.
    ("budget.set", {"tinker_path": PATH}, None, None),
    ("checkpoint.published", {"tinker_path": "tinker://only-run"}, None, None),
    ("checkpoint.published", {"tinker_path": 7}, None, None),
    ("checkpoint.published", {}, None, None),
])
def test_checkpoint_events_carry_their_checkpoint_at_the_top(action, detail, path, model_id):
    entry = audit_entry(AT, action, detail, "key:abc")
    assert entry["event"] == action.replace(".", "_") and entry["event_details"] == {**detail, "actor": "key:abc"}
    assert entry.get("tinker_path") == path and entry.get("model_id") == model_id
