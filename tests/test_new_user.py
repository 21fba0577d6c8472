"""What a new user following the README tripped over (issue 47's table): each row's behaviour,
against what the user typed and what the files on disk say."""

import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, descendants, kill_tree, train_env


def cli(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "canon_titan.cli", *map(str, args)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def test_a_global_batch_that_does_not_split_names_its_value_and_what_fits(monkeypatch):
    """Row 1: ``plan Llama-1B --gpus 256``: the value (1024), the product it must divide by, and
    overrides that fit, each of which really validates at its size."""
    from canon_titan.config import ConfigError, load

    recipe = REPO / "train_configs" / "Llama-1B-Nemo-1T-lr0.003.toml"
    monkeypatch.setenv("WORLD_SIZE", "256")
    with pytest.raises(ConfigError) as refused:
        load(recipe, [], environment=False)
    message = str(refused.value)
    assert "is 1024" in message and "8 x 256 = 2048" in message, message
    fixes = re.findall(r"--training\.local_batch_size (\d+)", message)
    counts = re.findall(r"(\d+) processes", message.split("fits:")[1])
    assert fixes and counts
    for local in fixes:  # each suggestion is a run that validates
        load(recipe, ["--training.local_batch_size", local], environment=False)
    for n in counts:
        monkeypatch.setenv("WORLD_SIZE", n)
        load(recipe, [], environment=False)


def _expand(pattern: str) -> list[str]:
    """The shell's brace expansion of ``pattern`` (no nesting)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*options)]


def test_the_readme_recipe_name_patterns_expand_to_the_files_that_exist():
    """Row 13: each pattern of the Release recipes section expands to names a user can type: files
    that exist, all of them, once (at 4a7b0a2 one pattern expanded to 36 names, of which 16
    existed)."""
    configs = (REPO / "docs" / "configs.md").read_text()
    section = configs[configs.index("## Release recipes") :]
    patterns = [p for p in re.findall(r"`([^`\s]*\{[^`\s]*\.toml)`", section)]
    names = [name for p in patterns for name in _expand(p)]
    assert all((REPO / n).is_file() or (REPO / "train_configs" / n).is_file() for n in names), names
    on_disk = sorted(p.name for p in (REPO / "train_configs").glob("*-Nemo-*.toml"))
    assert len(patterns) >= 4 and sorted(n for n in names if "-Nemo-" in n) == on_disk


def test_each_row_of_the_readme_recipe_plan_names_its_recipes():
    """Row 1: each row of the planned-recipes table names the recipe files it plans (at 4a7b0a2 an
    unlabelled "Llama-1B, 256 GPUs" row was the 2T recipe, and invited planning the 1T one at
    256)."""
    page = (REPO / "docs" / "benchmarks" / "planner.md").read_text()
    body = page.split("<!-- plan:recipes -->", 1)[1].split("<!-- /plan:recipes -->", 1)[0]
    cells = [
        line.strip("|").split("|")[0].strip() for line in body.splitlines() if line.startswith("| ")
    ]
    names = [
        name for cell in cells[1:] for part in cell.split(" / ") for name in _expand(part + ".toml")
    ]
    assert sorted(names) == sorted(p.name for p in (REPO / "train_configs").glob("*-Nemo-*.toml"))


def test_the_readme_writes_only_under_ignored_folders():
    """Row 8: every folder or file the README's commands write (conversion outputs, dump folders,
    --out files) is ignored by git, so the tree is clean after following the guide."""
    guide = "\n".join(
        p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    )
    written = set()
    for block in re.findall(r"```bash\n(.*?)```", guide, re.S):
        block = block.replace("\\\n", " ")
        written |= set(re.findall(r"convert (?:to-hf|from-hf) \S+ (\S+)", block))
        written |= set(re.findall(r"--job\.dump_folder (\S+)", block))
        written |= {w for w in re.findall(r"--out (\S+)", block) if not w.startswith("$")}
        written |= set(re.findall(r"--write (\S+)", block))  # plan --search's winner
    assert {
        "outputs/hf/debug",
        "outputs/dcp/debug",
        "outputs/LlamaCanon-8B-64xH100.toml",
    } <= written
    written = {w for w in written if not os.path.isabs(w)}  # a path of the user's own (/data/...)
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *sorted(written)],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert sorted(ignored) == sorted(written), sorted(written - set(ignored))


def test_unknown_options_name_the_option_meant():
    """Row 11: a misspelt option is an unknown option with the one meant, not a malformed
    override."""
    plan = cli("plan", "train_configs/llama_debug.toml", "--gpus", "8", "--gpus_per_node", "4")
    assert (
        plan.returncode == 2
        and "unknown option --gpus_per_node; did you mean --gpus-per-node?" in plan.stderr
    )
    train = cli("train", "--config", "train_configs/llama_debug.toml", "--nprocs", "2")
    assert (
        train.returncode == 2 and "unknown option --nprocs; did you mean --nproc?" in train.stderr
    )
    assert "expected an override" not in plan.stderr + train.stderr


def test_dtypes_take_either_spelling_in_the_toml_and_on_the_command_line():
    """Row 7: ``bfloat16`` on the command line (the TOML's spelling) and ``bf16`` in the TOML (the
    command line's) are the same dtype; a wrong one names both spellings."""
    from canon_titan.cli.common import dtype_arg
    from canon_titan.config import load

    assert [dtype_arg(t) for t in ("bf16", "bfloat16", "fp32", "float32", "float16")] == [
        "bf16",
        "bf16",
        "fp32",
        "fp32",
        "fp16",
    ]
    run = load(
        REPO / "train_configs" / "llama_debug.toml",
        [
            "--checkpoint.export_dtype",
            "bf16",
            "--training.mixed_precision_param",
            "fp32",
            "--eval.dtype",
            "float32",
        ],
        environment=False,
    )
    assert (
        run["checkpoint"]["export_dtype"],
        run["training"]["mixed_precision_param"],
        run["eval"]["dtype"],
    ) == ("bfloat16", "float32", "fp32")
    bad = cli(
        "convert",
        "to-hf",
        "a",
        "b",
        "--config",
        "train_configs/llama_debug.toml",
        "--dtype",
        "bfloat",
    )
    assert bad.returncode == 2 and "bf16 (bfloat16)" in bad.stderr


def test_a_missing_load_step_lists_the_steps_there_are(tmp_path):
    """Row 10: ``--checkpoint.load_step 60`` where 50, 61 and 66 exist names them."""
    from canon_titan.convert.dcp_io import NoLoadableCheckpoint, resume_step

    for step in (50, 61, 66):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    with pytest.raises(
        NoLoadableCheckpoint, match=r"has no complete step-60; the steps it holds: 50, 61, 66$"
    ):
        resume_step(tmp_path, 60)


def test_an_unedited_recipe_names_every_path_to_edit_at_once(tmp_path):
    """Row 12: both placeholders of a release recipe (tokenizer and data) in one line, each as
    "does not exist"; once one is edited, the other alone."""
    recipe = "train_configs/Llama-1B-Nemo-1T-lr0.003.toml"
    both = cli("config", "validate", recipe)
    assert both.returncode == 2
    assert re.search(
        r"\[tokenizer\] path = '[^']+' does not exist; \[dataloader\] dataset_path = "
        r"'[^']+' does not "
        r"exist",
        both.stdout + both.stderr,
    ), both.stdout + both.stderr
    one = cli("config", "validate", recipe, "--dataloader.dataset_path", tmp_path)
    assert (
        "[tokenizer] path = " in one.stdout + one.stderr
        and "dataset_path = " not in one.stdout + one.stderr
    )


def test_a_missing_kernel_package_is_named_as_not_installed(monkeypatch):
    """Row 15: gpu_check's environment line says ``mamba-ssm: not installed``, not a
    ModuleNotFoundError; a package that is there but fails to import keeps its error."""
    from canon_titan.kernels import backends

    def missing(backend):
        raise ModuleNotFoundError("No module named 'mamba_ssm'", name="mamba_ssm")

    backends.import_problem.cache_clear()
    monkeypatch.setattr(backends, "_import", missing)
    assert backends.import_problem("mamba_ssm") == "mamba-ssm: not installed"
    backends.import_problem.cache_clear()

    def broken(backend):
        raise ModuleNotFoundError("No module named 'einops'", name="einops")

    monkeypatch.setattr(backends, "_import", broken)
    assert backends.import_problem("mamba_ssm") == "ModuleNotFoundError: No module named 'einops'"
    backends.import_problem.cache_clear()


def test_a_checkpoint_of_another_family_is_named_as_such(tmp_path):
    """Row 6: ``convert from-hf`` of a LlamaCanon export with a llama config says the families
    differ, not that ``rope_dim`` is 8 where 32 is expected."""
    from canon_titan.config import load
    from canon_titan.convert.hf import to_hf
    from conftest import CONFIGS, make_checkpoint

    _, step, _ = make_checkpoint(tmp_path, [])
    run = load(CONFIGS["llama_canon"], [], environment=False)
    to_hf(step, tmp_path / "hf", run)
    refused = cli(
        "convert", "from-hf", tmp_path / "hf", tmp_path / "dcp", "--config", CONFIGS["llama"]
    )
    line = refused.stderr.strip().splitlines()[-1]
    canon_set = json.loads((tmp_path / "hf" / "config.json").read_text())["canon_set"]
    assert (
        refused.returncode == 2
        and f"the folder holds a model with Canon layers {canon_set}, the run's Llama has "
        "none: use the config of the model the folder holds"
        in line
    ), refused.stderr[-2000:]
    assert line.index("Canon layers") < line.index("rope_dim")  # the family first, then the fields
    assert not (tmp_path / "dcp").exists()


def test_known_harmless_library_lines_are_filtered_and_nothing_else(caplog):
    """Row 9: torchao's CUDA-kernel load failures, torch's pytree enum notice and DTensor's
    two-step norm reduction note are dropped from canon-titan's processes; other records of the
    same loggers pass (the filters a canon-titan program installs as it starts)."""
    from canon_titan.tools.startup import process_setup

    process_setup()
    for name, noise, kept in [
        (
            "torchao",
            "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library",
            "quantizing 3 layers",
        ),
        (
            "torch.utils._pytree",
            "<enum 'X'> is an Enum subclass and is now natively supported by torch.compile",
            "another pytree warning",
        ),
        (
            "torch.distributed.tensor._redistribute",
            "While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to "
            "(Replicate(), Replicate())",
            "While redistributing from (Shard(0),) to (Replicate(),)",
        ),
    ]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=name):
            logging.getLogger(name).warning(noise)
            logging.getLogger(name).warning(kept)
        assert [r.getMessage() for r in caplog.records] == [kept], name


def test_a_plan_with_tensor_parallelism_prints_its_table_without_library_notes():
    """Row 9: the plan of llama_debug at TP 2 has no DTensor ``_NormPartial`` line in its table."""
    plan = cli(
        "plan",
        "train_configs/llama_debug.toml",
        "--gpus",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    )
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert (
        "_NormPartial" not in plan.stdout + plan.stderr
        and "Failed to load" not in plan.stdout + plan.stderr
    )


def test_a_typo_in_playground_check_is_refused_before_any_training(tmp_path):
    """Row 2: ``--check k1:40`` (a group no task has) and ``--check 40`` (no group) stop at once,
    naming the groups there are, before anything trains."""
    for check, expected in [
        ("k1:40", "depo has no group 'k1'; its groups: k=1"),
        ("40", "expected GROUP:POINTS"),
    ]:
        started = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "scripts/playground.py",
                "--tasks",
                "depo",
                "--check",
                check,
                "--out",
                str(tmp_path),
            ],
            cwd=REPO,
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
        assert "+ " not in proc.stdout and not any(tmp_path.iterdir())
        assert time.monotonic() - started < 60


@pytest.mark.slow
def test_stopping_the_playground_stops_its_training_runs(tmp_path):
    """Row 3: SIGTERM (or SIGKILL) to playground.py while its two runs train: both runs stop (they
    are not left training as orphans)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        out = tmp_path / sig.name
        proc = subprocess.Popen(
            [
                sys.executable,
                "scripts/playground.py",
                "--tasks",
                "depo",
                "--steps",
                "400",
                "--out",
                str(out),
            ],
            cwd=REPO,
            env=train_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            for line in proc.stdout:
                if "progress:" in line:  # a run is training
                    break
            runs = descendants(proc.pid)
            assert any("canon_titan.train" in _cmdline(p) for p in runs)
            os.kill(proc.pid, sig)
            proc.wait(timeout=60)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and any(map(_running, runs)):
                time.sleep(1)
            alive = [p for p in runs if _running(p)]
            assert not alive, f"{sig.name}: still running: {alive}"
        finally:
            kill_tree(proc.pid)
            for p in descendants(proc.pid):
                kill_tree(p)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""
