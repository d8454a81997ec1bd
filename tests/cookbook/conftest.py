"""The recipe suite: tinker-cookbook 0.6.1's own training loops run unchanged against the embedded
stack, on the tiny base, offline, with data written by the tests.

Each test is what a user of a self-hosted base does: the tinker SDK finds Quilt through
`base_url` and `TINKER_API_KEY`, and the cookbook's tokenizer registry names the base's tokenizer
(`tokenizer_utils.register_tokenizer`, the cookbook's own hook for a model that is not on the hub).
Only pieces that need the outside world are replaced (hub datasets by local data, hosted judges and
sandboxes by local functions); each test says which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from stackutil import TINY

pytest.importorskip("tinker_cookbook", reason="the recipe suite needs tinker-cookbook (scripts/install.sh)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/cookbook/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.cookbook)


@pytest.fixture(scope="session")
def tiny_path(stack) -> str:
    from bases.catalog import get_model_sync
    from core import db

    with db.connect(stack.database_url) as conn:
        return get_model_sync(conn, TINY).path


@pytest.fixture(scope="session")
def cookbook(stack, tiny_path):
    """The stack's address and a tenant's key where the tinker SDK looks for them, and the tiny
    base's tokenizer registered under the base's name."""
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    tenant = stack.create_tenant("cookbook")
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    tokenizer_utils.register_tokenizer(TINY, lambda: tokenizer)
    saved = {k: os.environ.get(k) for k in ("TINKER_API_KEY", "TINKER_BASE_URL")}
    os.environ["TINKER_API_KEY"] = tenant.key
    os.environ["TINKER_BASE_URL"] = stack.base_url
    yield stack.base_url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tokenizer_utils.unregister_tokenizer(TINY)


@dataclass(frozen=True)
class SftRun:
    log_path: Path
    early_state: str  # the weights after SFT_EARLY_STEP steps: a student that has begun to learn
    final_sampler: str  # the final sampler weights: the distillation tests' teacher
    final_state: str  # the final training checkpoint: what the weights test downloads


SFT_EARLY_STEP = 3


@pytest.fixture(scope="session")
def sft_run(cookbook, tmp_path_factory) -> SftRun:
    """`supervised.train` on the conversations of recipes.CHAT, run once: the supervised test reads
    its curve, and the distillation tests distil its final weights into its early ones."""
    import asyncio

    from recipes import RENDERER, chat_builder
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.supervised import train as sft

    root = tmp_path_factory.mktemp("sft")
    config = sft.Config(log_path=str(root / "run"), model_name=TINY, recipe_name="quilt_sft",
                        renderer_name=RENDERER, dataset_builder=chat_builder(root / "chat.jsonl"),
                        learning_rate=5e-3, num_epochs=3, lora_rank=16, save_every=SFT_EARLY_STEP, eval_every=0,
                        base_url=cookbook)
    asyncio.run(sft.main(config))
    saved = checkpoint_utils.load_checkpoints_file(str(root / "run"))
    early = next(c for c in saved if c.batch == SFT_EARLY_STEP)
    return SftRun(root / "run", early.state_path, saved[-1].sampler_path, saved[-1].state_path)
