"""A mixed, multi-tenant training workload for the billing tests, and ledger read-back helpers.

Each tenant gets one model and a second API key; it runs forward_backward passes of varied sizes,
optimizer steps, a forward pass, a save, one save that fails in the trainer (its name is taken) and
one forward_backward refused at the edge (a bad loss config: its seq_id is recorded as a failed
request and passed by the trainer), neither of which may be billed. Requests are pipelined: submitted first, then awaited.

When the server has the generation pool's `/asample` route, each tenant also samples groups from the
base model (prefill and sampled tokens, recorded by the pool through `billing.ledger.record_usage`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import httpx
import psycopg
from psycopg.rows import dict_row
from stackutil import ADAM, TINY, datum, fb_body, new_model, wait_future

from billing.pricing import Price, Units, cost_of
from core import db


@dataclass
class Submitted:
    request_id: str
    kind: str
    tenant_id: str
    key_name: str
    expect_ok: bool
    result: dict | None = None


@dataclass
class Workload:
    tenants: list = field(default_factory=list)
    requests: list[Submitted] = field(default_factory=list)
    refused: list[tuple[str, int]] = field(default_factory=list)  # (model_id, seq_id) refused at the edge

    @property
    def tenant_ids(self) -> list[str]:
        return [t.tenant_id for t in self.tenants]


def run_workload(stack, *, n_tenants: int = 3, seed: int = 0, prefix: str = "bill") -> Workload:
    from tenancy.keys import create_key

    rng = random.Random(seed)
    work = Workload()
    pending: list[tuple] = []
    sampling = sampling_available(stack)
    for i in range(n_tenants):
        tenant = stack.create_tenant(f"{prefix}{i}")
        work.tenants.append(tenant)
        with db.connect(stack.database_url) as conn:
            second_key, _ = create_key(conn, tenant.tenant_id, name="second")
        clients = {"first": stack.http(tenant.key), "second": stack.http(second_key)}
        model = new_model(clients["first"], rank=4, seed=i)
        seq = 1

        def submit(path: str, body: dict, kind: str, key: str = "first", ok: bool = True,
                   clients: dict = clients, tenant_id: str = tenant.tenant_id) -> None:
            r = clients[key].post(path, json=body)
            r.raise_for_status()
            pending.append((clients[key], Submitted(r.json()["request_id"], kind, tenant_id, key, ok)))

        for step in range(2 + i):
            data = [datum([rng.randrange(1, 250) for _ in range(rng.randint(4, 40))]) for _ in range(1 + step % 3)]
            key = "second" if step % 2 else "first"
            submit("/forward_backward", fb_body(model, seq, data), "forward_backward", key)
            submit("/optim_step", {"model_id": model, "seq_id": seq + 1, "adam_params": ADAM}, "optim_step", key)
            seq += 2
        probe = [datum([rng.randrange(1, 250) for _ in range(rng.randint(4, 30))]) for _ in range(2)]
        submit("/forward", fb_body(model, seq, probe), "forward")
        refused = clients["first"].post("/forward_backward", json=fb_body(model, seq + 1, probe,
                                                                          loss_fn_config={"no_such_knob": 1.0}))
        assert refused.status_code == 400, refused.text
        work.refused.append((model, seq + 1))
        submit("/save_weights", {"model_id": model, "seq_id": seq + 2, "path": f"bill-{i}"}, "save_weights")
        submit("/save_weights", {"model_id": model, "seq_id": seq + 3, "path": f"bill-{i}"}, "save_weights", ok=False)
        if sampling:
            session = clients["first"].post("/create_session", json={}).json()["session_id"]
            sampler = clients["first"].post("/create_sampling_session", json={
                "session_id": session, "sampling_session_seq_id": 0, "base_model": TINY}).json()["sampling_session_id"]
            for j in range(1 + i):
                prompt = [rng.randrange(1, 250) for _ in range(rng.randint(3, 12))]
                submit("/asample", {"sampling_session_id": sampler, "num_samples": 1 + j,
                                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                                    "sampling_params": {"max_tokens": rng.randint(2, 10), "seed": j}},
                       "sample", "second" if j % 2 else "first")
    for client, sub in pending:
        result = wait_future(client, sub.request_id)
        assert ("error" not in result) == sub.expect_ok, (sub, result)
        sub.result = result
        work.requests.append(sub)
    wait_recorded(stack.database_url, work.tenant_ids)
    return work


def sampling_available(stack) -> bool:
    """Whether this server has the generation pool's sampling routes."""
    paths = httpx.get(stack.base_url + "/openapi.json", timeout=30).json()["paths"]
    return "/api/v1/asample" in paths


def wait_recorded(database_url: str, tenant_ids: list[str], timeout_s: float = 30) -> None:
    """Futures are answered (Redis) a moment before the request row and its ledger row commit:
    wait until no request of these tenants is still queued or running."""
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(database_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            left = conn.execute("SELECT count(*) FROM requests WHERE tenant_id = ANY(%s) AND "
                                "status IN ('queued', 'running')", (tenant_ids,)).fetchone()[0]
            if not left:
                return
            time.sleep(0.05)
    raise TimeoutError(f"{left} requests still unrecorded after {timeout_s}s")


def ledger_rows(database_url: str, tenant_ids: list[str]) -> list[dict]:
    """Ledger rows of these tenants, each with its price-book entry (p_* columns)."""
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT l.*, p.base_model AS p_base_model, p.effective_from AS p_effective_from, "
            "p.prefill_micro_usd_per_mtok AS p_prefill, p.sample_micro_usd_per_mtok AS p_sample, "
            "p.train_micro_usd_per_mtok AS p_train, p.cached_micro_usd_per_mtok AS p_cached, "
            "p.storage_micro_usd_per_gb_month AS p_storage "
            "FROM usage_ledger l LEFT JOIN price_book p ON p.id = l.price_id WHERE l.tenant_id = ANY(%s)",
            (tenant_ids,),
        ).fetchall()


def recomputed_cost(row: dict) -> int:
    """A ledger row's cost recomputed from its units and its price-book entry."""
    price = None
    if row["price_id"] is not None:
        price = Price(row["p_base_model"], row["p_effective_from"], row["p_prefill"], row["p_sample"],
                      row["p_train"], id=row["price_id"], cached_micro_usd_per_mtok=row["p_cached"],
                      storage_micro_usd_per_gb_month=row["p_storage"])
    units = Units(row["prefill_tokens"], row["sample_tokens"], row["train_tokens"], row["cached_tokens"],
                  row["storage_byte_hours"])
    return cost_of(units, price).total_micro_usd


def ledger_totals(database_url: str, tenant_ids: list[str]) -> dict[str, dict[str, int]]:
    """tenant -> {meter key -> total} straight from the ledger."""
    out: dict[str, dict[str, int]] = {}
    for r in ledger_rows(database_url, tenant_ids):
        t = out.setdefault(r["tenant_id"], {"cost_micro_usd": 0, "prefill_tokens": 0, "sample_tokens": 0,
                                            "train_tokens": 0})
        for k in t:
            t[k] += int(r[k])
    return out
