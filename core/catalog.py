"""The base-model catalogue: which bases this installation serves, where their files live."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg.rows import dict_row


@dataclass(frozen=True)
class BaseModel:
    name: str
    path: str
    vocab_size: int
    max_context_length: int
    trainable: bool = True
    sampleable: bool = True

    def capability(self) -> dict:
        """The Tinker `get_server_capabilities` entry."""
        return {
            "model_name": self.name,
            "max_context_length": self.max_context_length,
            "trainable": self.trainable,
            "sampleable": self.sampleable,
        }


_COLUMNS = "name, path, vocab_size, max_context_length, trainable, sampleable"


def register(conn: psycopg.Connection, model: BaseModel) -> None:
    conn.execute(
        f"INSERT INTO base_models ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (name) DO UPDATE SET path = EXCLUDED.path, vocab_size = EXCLUDED.vocab_size, "
        "max_context_length = EXCLUDED.max_context_length",
        (model.name, model.path, model.vocab_size, model.max_context_length, model.trainable, model.sampleable),
    )


def list_models_sync(conn: psycopg.Connection) -> list[BaseModel]:
    return [BaseModel(**r) for r in conn.execute(f"SELECT {_COLUMNS} FROM base_models ORDER BY name")]


async def list_models(conn) -> list[BaseModel]:
    cur = await conn.execute(f"SELECT {_COLUMNS} FROM base_models ORDER BY name")
    return [BaseModel(**r) for r in await cur.fetchall()]


async def get_model(conn, name: str) -> BaseModel | None:
    cur = await conn.execute(f"SELECT {_COLUMNS} FROM base_models WHERE name = %s", (name,))
    row = await cur.fetchone()
    return BaseModel(**row) if row else None


def get_model_sync(conn: psycopg.Connection, name: str) -> BaseModel | None:
    row = conn.execute(f"SELECT {_COLUMNS} FROM base_models WHERE name = %s", (name,)).fetchone()
    return BaseModel(**row) if row else None


def worker_base(db_url: str, name: str) -> BaseModel:
    """The base model a worker serves, read at its start; exits naming the fix when it is not in
    the catalogue."""
    with psycopg.connect(db_url, row_factory=dict_row) as conn:
        base = get_model_sync(conn, name)
    if base is None:
        raise SystemExit(f"base model {name!r} is not in the catalogue; run `quilt models create-tiny`")
    return base
