"""The base-model catalogue: which bases this installation serves, what they are, where their files
live and how their workers are set up. Rows are written by `quilt models add` (bases.model_sources
validates first) and read by the API and the workers."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import psycopg
from psycopg.rows import DictRow, dict_row, tuple_row
from psycopg.types.json import Jsonb

from core import db
from core.errors import Conflict, NotFound


@dataclass(frozen=True)
class BaseModel:
    name: str
    path: str  # the directory the workers load (a hub model's snapshot in the hub cache)
    vocab_size: int
    max_context_length: int
    trainable: bool = True
    sampleable: bool = True
    architecture: str = "qwen3"  # config.model_type, one of bases.architectures.SUPPORTED
    config: dict = field(default_factory=dict)  # config.json
    source: str = "path"  # 'path' or 'hub'
    hub_id: str | None = None
    revision: str | None = None
    dtype: str = "auto"  # 'auto' (bfloat16 on GPU, float32 on CPU), 'bfloat16' or 'float32'
    tokenizer_id: str = ""  # what clients load the tokenizer from: the hub id, or the local path
    renderer: str = ""  # chat renderer when the tokenizer has no chat template ('' = its template)
    num_parameters: int = 0
    active_parameters: int = 0  # per token (MoE: routed experts only)
    serving: dict = field(default_factory=dict)  # per-base worker settings (see stack.launcher)

    def capability(self) -> dict:
        """The Tinker `get_server_capabilities` entry."""
        return {
            "model_name": self.name,
            "max_context_length": self.max_context_length,
            "trainable": self.trainable,
            "sampleable": self.sampleable,
        }

    @property
    def client_tokenizer(self) -> str:
        return self.tokenizer_id or self.path


_FIELDS = [f.name for f in fields(BaseModel)]
_COLUMNS = ", ".join(_FIELDS)
_JSON = {"config", "serving"}
_LISTED = "removed_at IS NULL"


def _values(model: BaseModel) -> list:
    return [Jsonb(getattr(model, f)) if f in _JSON else getattr(model, f) for f in _FIELDS]


def register(conn: psycopg.Connection[DictRow], model: BaseModel) -> None:
    """Add a base, or replace the entry of the same name (bringing back a removed one)."""
    updates = ", ".join(f"{f} = EXCLUDED.{f}" for f in _FIELDS if f != "name")
    conn.execute(
        f"INSERT INTO base_models ({_COLUMNS}) VALUES ({', '.join(['%s'] * len(_FIELDS))}) "
        f"ON CONFLICT (name) DO UPDATE SET {updates}, removed_at = NULL",
        _values(model),
    )


def remove(conn: psycopg.Connection[DictRow], name: str) -> None:
    """Stop serving a base. Refused (Conflict) while training models of it are live; its row stays,
    unlisted, while models or ledger rows refer to it."""
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(f"SELECT name FROM base_models WHERE name = %s AND {_LISTED} FOR UPDATE",
                          (name,)).fetchone()
        if row is None:
            raise NotFound(f"base model {name!r} is not in the catalogue", field="name")
        live, refs = db.one(cur.execute(
            "SELECT count(*) FILTER (WHERE status IN ('creating', 'ready', 'recovering')), count(*) "
            "FROM training_models WHERE base_model = %s", (name,)).fetchone())
        if live:
            raise Conflict(f"{live} training models of {name!r} are live; they must finish (or be deleted) "
                           "before the base can be removed", field="name")
        if refs:
            cur.execute("UPDATE base_models SET removed_at = now(), trainable = false, sampleable = false "
                        "WHERE name = %s", (name,))
        else:
            cur.execute("DELETE FROM base_models WHERE name = %s", (name,))


def _model(row) -> BaseModel:
    return BaseModel(**{k: row[k] for k in _FIELDS})


def list_models_sync(conn: psycopg.Connection[DictRow]) -> list[BaseModel]:
    with conn.cursor(row_factory=dict_row) as cur:
        return [_model(r) for r in cur.execute(f"SELECT {_COLUMNS} FROM base_models WHERE {_LISTED} ORDER BY name")]


async def list_models(conn) -> list[BaseModel]:
    cur = await conn.execute(f"SELECT {_COLUMNS} FROM base_models WHERE {_LISTED} ORDER BY name")
    return [_model(r) for r in await cur.fetchall()]


async def get_model(conn, name: str) -> BaseModel | None:
    """A base by name, removed ones included (existing models still describe themselves)."""
    cur = await conn.execute(f"SELECT {_COLUMNS} FROM base_models WHERE name = %s", (name,))
    row = await cur.fetchone()
    return _model(row) if row else None


def get_model_sync(conn: psycopg.Connection[DictRow], name: str) -> BaseModel | None:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(f"SELECT {_COLUMNS} FROM base_models WHERE name = %s", (name,)).fetchone()
    return _model(row) if row else None


def worker_base(db_url: str, name: str) -> BaseModel:
    """The base model a worker serves, read at its start; exits naming the fix when it is not in
    the catalogue."""
    with psycopg.connect(db_url, row_factory=dict_row) as conn:
        base = get_model_sync(conn, name)
    if base is None:
        raise SystemExit(f"base model {name!r} is not in the catalogue; add it with `quilt models add`")
    return base
