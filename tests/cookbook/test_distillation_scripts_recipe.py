"""recipes/distillation through its own scripts (`on_policy_distillation`, `off_policy_reasoning`,
`on_policy_multi_teacher`, `on_policy_distillation_harbor_multi_turn` with `harbor_multiturn`): each
script's CLIConfig and cli_main, unchanged. test_distillation_recipes.py drives the library loops;
these tests drive what a user runs. The teacher is the supervised recipe's final weights
(conftest.sft_run) named by the scripts' own `teacher_model`/`teacher_checkpoint`.

Replaced: the hub's DeepMath, Tulu3 and OpenThoughts3 (`datasets.load_dataset`) by rows in the hub's
own shapes built from recipes.CHAT; the harbor recipe's Modal sandbox by a local one (a shell in a
temporary directory, passed through the script's own `sandbox_factory` option) and its task cache
(`~/.cache/harbor/tasks`) by one task written in the test."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import datasets
import pytest
from recipes import CHAT, RENDERER, TINY, first_last, metrics, series

PROMPTS = [conversation[0]["content"] for conversation in CHAT]


def _hub_rows(copies: int):
    """What `load_dataset` answers for the two prompt sets the distillation scripts read."""
    rows = {"zwhe99/DeepMath-103K": [{"question": p} for p in PROMPTS * copies],
            "allenai/tulu-3-sft-mixture": [{"messages": [{"role": "user", "content": p},
                                                         {"role": "assistant", "content": "ok"}]}
                                           for p in reversed(PROMPTS * copies)]}

    def load_dataset(path, *args, split=None, **kwargs):
        if split != "train":
            raise ValueError(f"{path} has no split {split!r} here")
        return rows[path]
    return load_dataset


@pytest.mark.extended
def test_on_policy_distillation_script_closes_the_gap(cookbook, sft_run, tmp_path, monkeypatch):
    from tinker_cookbook.distillation import datasets as distill_data
    from tinker_cookbook.recipes.distillation import on_policy_distillation as script

    monkeypatch.setattr(distill_data, "load_dataset", _hub_rows(copies=4))
    log = tmp_path / "run"
    cli = script.CLIConfig(model_name=TINY, renderer_name=RENDERER, load_checkpoint_path=sft_run.early_state,
                           teacher_model=TINY, teacher_checkpoint=sft_run.final_sampler, dataset="deepmath",
                           group_size=8, groups_per_batch=4, learning_rate=1e-3, max_tokens=8, lora_rank=16,
                           eval_every=0, save_every=0, log_path=str(log), base_url=cookbook, max_steps=8)
    asyncio.run(script.cli_main(cli))
    kl = series(metrics(log), "teacher_kl")
    first, last = first_last(kl)
    print(f"on_policy_distillation (deepmath rows) teacher_kl {first:.3f} -> {last:.3f} in {len(kl)} steps")
    assert len(kl) == 8
    assert last < first


@pytest.mark.extended
def test_off_policy_reasoning_script_learns_the_traces(cookbook, tmp_path, monkeypatch):
    from tinker_cookbook.recipes.distillation import off_policy_reasoning as script

    traces = [{"conversations": [{"from": "human", "value": m[0]["content"]}, {"from": "gpt", "value": m[1]["content"]}]}
              for m in CHAT * 6]

    def load_dataset(path, *args, split=None, streaming=False, **kwargs):
        assert path == "open-thoughts/OpenThoughts3-1.2M" and split == "train" and streaming
        return datasets.Dataset.from_list(traces).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    log = tmp_path / "run"
    cli = script.CLIConfig(model_name=TINY, renderer_name=RENDERER, lora_rank=16, batch_size=8, learning_rate=5e-3,
                           max_length=256, buffer_size=len(traces), max_prompts=len(traces), eval_every=0,
                           save_every=0, log_path=str(log), base_url=cookbook)
    script.cli_main(cli)
    nll = series(metrics(log), "train_mean_nll")
    first, last = first_last(nll)
    print(f"off_policy_reasoning (OpenThoughts3-shaped rows) nll {first:.3f} -> {last:.3f} in {len(nll)} steps")
    assert len(nll) == len(traces) // 8
    assert last < 0.8 * first


@pytest.mark.extended
def test_on_policy_multi_teacher_script_runs_two_teachers(cookbook, sft_run, tmp_path, monkeypatch):
    """Two datasets, two teachers: DeepMath's is the supervised run's final weights, Tulu3's the tiny
    base itself. Three steps, each batch drawing from both: the protocol, not a curve."""
    from tinker_cookbook.distillation import datasets as distill_data
    from tinker_cookbook.recipes.distillation import on_policy_multi_teacher as script

    monkeypatch.setattr(distill_data, "load_dataset", _hub_rows(copies=2))
    log = tmp_path / "run"
    cli = script.CLIConfig(model_name=TINY, renderer_name=RENDERER, load_checkpoint_path=sft_run.early_state,
                           deepmath_teacher_model=TINY, deepmath_teacher_checkpoint=sft_run.final_sampler,
                           tulu3_teacher_model=TINY, deepmath_groups_per_batch=2, tulu3_groups_per_batch=2,
                           group_size=2, learning_rate=1e-3, max_tokens=8, lora_rank=8, eval_every=0, save_every=0,
                           log_path=str(log), base_url=cookbook, max_steps=3)
    asyncio.run(script.cli_main(cli))
    rows = metrics(log)
    deepmath, tulu3 = series(rows, "teacher_kl/dataset_0"), series(rows, "teacher_kl/dataset_1")
    print(f"on_policy_multi_teacher: teacher_kl deepmath {deepmath}, tulu3 {tulu3}")
    assert len(deepmath) == len(tulu3) == 3
    assert all(abs(v) < 50 for v in deepmath + tulu3)


class LocalSandbox:
    """The harbor recipe's SandboxInterface on this machine: each command runs in a restricted bash
    (no cd, no redirection, PATH fixed to a few read-only tools) in a directory of its own, whatever
    workdir the tool asks for. A stand-in for the task's container, which this machine cannot build."""

    TOOLS = ("ls", "cat", "echo", "pwd", "wc", "head")

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bin").mkdir(parents=True)
        for name in self.TOOLS:
            (root / "bin" / name).symlink_to(shutil.which(name) or f"/bin/{name}")

    @property
    def sandbox_id(self) -> str:
        return str(self.root)

    async def send_heartbeat(self, timeout: int = 30) -> None:  # noqa: ASYNC109
        return None

    async def run_command(self, command, workdir=None, timeout=60, max_output_bytes=None):  # noqa: ASYNC109
        from tinker_cookbook.sandbox import SandboxResult

        env = {"PATH": str(self.root / "bin"), "HOME": str(self.root)}
        proc = await asyncio.create_subprocess_exec("/bin/bash", "-r", "-c", command, cwd=self.root, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), min(timeout, 10))
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return SandboxResult(stdout="", stderr="timed out", exit_code=124)
        cap = max_output_bytes or 4096
        return SandboxResult(stdout=out.decode(errors="replace")[:cap], stderr=err.decode(errors="replace")[:cap],
                             exit_code=proc.returncode or 0)

    async def read_file(self, path, max_bytes=None, timeout=60):  # noqa: ASYNC109
        from tinker_cookbook.sandbox import SandboxResult

        target = self.root / path.lstrip("/")
        if not target.is_file():
            return SandboxResult(stdout="", stderr=f"{path}: no such file", exit_code=1)
        return SandboxResult(stdout=target.read_text()[:max_bytes], stderr="", exit_code=0)

    async def write_file(self, path, content, executable=False, timeout=60):  # noqa: ASYNC109
        from tinker_cookbook.sandbox import SandboxResult

        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode() if isinstance(content, str) else content)
        if executable:
            os.chmod(target, 0o755)
        return SandboxResult(stdout="", stderr="", exit_code=0)

    async def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _harbor_tasks(cache: Path, dataset: str) -> None:
    """Two tasks in harbor's layout (instruction.md, task.toml, environment/Dockerfile, tests/test.sh)."""
    for name, instruction in (("list-files", "List the files in the current directory."),
                              ("print-dir", "Print the working directory.")):
        task = cache / dataset / name
        (task / "environment").mkdir(parents=True)
        (task / "tests").mkdir()
        (task / "instruction.md").write_text(instruction)
        (task / "task.toml").write_text('[metadata]\ndifficulty = "easy"\n')
        (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\n")
        (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")


@pytest.mark.extended
def test_harbor_multi_turn_distillation_runs_on_a_local_sandbox(cookbook, sft_run, tmp_path, monkeypatch):
    """The harbor script's own `__main__` steps: `load_harbor_tasks(task_name)` then `cli_main`. The
    reward is the recipe's zero reward, so teacher KL is the only signal: two steps, the protocol."""
    from tinker_cookbook.recipes.distillation import on_policy_distillation_harbor_multi_turn as script
    from tinker_cookbook.recipes.harbor_rl import harbor_env

    monkeypatch.setattr(harbor_env, "HARBOR_CACHE_DIR", tmp_path / "harbor")
    _harbor_tasks(tmp_path / "harbor", "local-bench")
    made: list[LocalSandbox] = []

    async def local_sandbox(env_dir: Path, timeout: int) -> LocalSandbox:  # noqa: ASYNC109
        assert (env_dir / "Dockerfile").exists()
        made.append(LocalSandbox(tmp_path / "sandboxes" / str(len(made))))
        return made[-1]

    log = tmp_path / "run"
    cli = script.CLIConfig(model_name=TINY, renderer_name=RENDERER, load_checkpoint_path=sft_run.early_state,
                           teacher_model=TINY, teacher_checkpoint=sft_run.final_sampler, task_name="local-bench",
                           sandbox_factory=local_sandbox, max_turns=2, max_trajectory_tokens=1024, group_size=2,
                           groups_per_batch=1, learning_rate=1e-3, max_tokens=12, lora_rank=8, eval_every=0,
                           save_every=0, log_path=str(log), base_url=cookbook, max_steps=2)
    tasks = harbor_env.load_harbor_tasks(cli.task_name)
    asyncio.run(script.cli_main(cli, tasks))
    rows = metrics(log)
    kl = series(rows, "teacher_kl")
    print(f"harbor multi-turn distillation: {len(made)} local sandboxes, teacher_kl {kl}, "
          f"turns {series(rows, 'env/all/turns_per_episode')}")
    assert len(tasks) == 2 and len(made) == 4
    assert len(kl) == 2 and all(abs(v) < 50 for v in kl)
