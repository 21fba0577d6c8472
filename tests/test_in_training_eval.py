"""Evaluation during training ([eval]): config checks, the evaluator in one process against the
standalone scorers, and 2-process CPU trainings whose eval scalars land in TensorBoard and equal
`canon-titan eval lm / eval synthetic` run afterwards on the final checkpoint."""

import gc
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.multiprocessing as mp

from canon_titan.cli import main
from canon_titan.components.metrics import read_scalars
from canon_titan.config import ConfigError, load
from canon_titan.config.build import _eval_settings
from canon_titan.evaluation.in_training import InTrainingEval
from canon_titan.evaluation.synthetic import evaluate as evaluate_synthetic
from conftest import COMMON, CONFIGS, REPO, free_port, run_training, train_env, write_tiny_tasks
from test_failures import interrupt

DEPO = REPO / "train_configs" / "playground" / "depo.toml"


@pytest.mark.parametrize(
    "overrides,key,message",
    [
        (["--eval.every", "2"], "[eval] every", "nothing to evaluate"),
        (
            ["--eval.every", "2", "--eval.synthetic", "true"],
            "[eval] synthetic",
            "needs a synthetic [dataloader] dataset",
        ),
        (["--eval.every", "-1"], "[eval] every", "must be >= 0"),
        (
            ["--eval.every", "2", "--eval.tasks", '["x"]', "--eval.limit", "-1"],
            "[eval] limit",
            "must be >= 0",
        ),
    ],
)
def test_eval_section_errors_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        load(CONFIGS["llama_canon"], overrides, environment=False)
    assert key in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("limit,passed", [(0, None), (7, 7)])
def test_limit_zero_scores_every_item(limit, passed):
    """``limit = 0`` (the release recipes' full evaluation) reaches lm-eval as its "no limit"."""
    run = load(
        CONFIGS["llama_canon"],
        ["--eval.every", "2", "--eval.tasks", '["x"]', "--eval.limit", str(limit)],
        environment=False,
    )
    assert _eval_settings(run, "").limit == passed


def _single_process_eval(run, max_seconds):
    settings = _eval_settings(run, str(REPO / "canon_titan" / "assets" / "builtin"))
    settings.max_seconds = max_seconds
    dims = types.SimpleNamespace(pp_enabled=False, pp=1)
    return InTrainingEval(settings, dims, torch.device("cpu"), total_steps=10)


def test_synthetic_scores_equal_the_standalone_scorer_and_respect_the_time_limit(tmp_path):
    from conftest import make_checkpoint

    overrides = [
        "--eval.every",
        "5",
        "--eval.synthetic",
        "true",
        "--eval.synthetic_count",
        "6",
        "--eval.dtype",
        "fp32",
        "--training.steps",
        "10",
    ]
    run, step, model = make_checkpoint(tmp_path, overrides, config=DEPO, seed=1)
    evaluator = _single_process_eval(run, max_seconds=600)
    assert [s for s in range(1, 11) if evaluator.due(s)] == [5, 10]
    metrics = evaluator.run([model], step=5)
    reference = evaluate_synthetic(run, step, count=6)
    assert (
        metrics["eval/depo1/items"] == reference["overall"]["total"] == 6 * 2
    )  # groups k=1, k=2 (K = 2)
    assert metrics["eval/depo1/accuracy"] == reference["overall"]["accuracy"]
    for group, g in reference["groups"].items():
        assert metrics[f"eval/depo1/{group}"] == g["accuracy"]

    hurried = _single_process_eval(run, max_seconds=1e-9).run([model], step=5)
    assert hurried["eval/depo1/items"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        [],  # FSDP over both ranks: rank 0 gathers the full weights
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
    ],
    ids=["fsdp", "pp"],
)
def test_two_process_training_logs_lm_eval_scores_equal_to_eval_lm(tmp_path, layout):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tiny_tasks(tasks, [{"q": "Count: 1, 2,", "a": " 3"}])
    dump = tmp_path / "run"
    run_training(
        2,
        COMMON
        + layout
        + [
            "--job.dump_folder",
            str(dump),
            "--training.steps",
            "4",
            "--checkpoint.enable",
            "--eval.every",
            "2",
            "--eval.tasks",
            '["tiny_mc", "tiny_ppl"]',
            "--eval.include_path",
            f'["{tasks}"]',
            "--eval.dtype",
            "fp32",
        ],
        config=CONFIGS["llama_canon"],
    )
    bpb = read_scalars(str(dump), "eval/tiny_ppl/bits_per_byte")
    assert sorted(bpb) == [2, 4]
    assert sorted(read_scalars(str(dump), "eval/tiny_mc/acc")) == [2, 4]
    assert bpb[2] != bpb[4]  # the weights changed between the two evaluations

    out = tmp_path / "after.json"
    assert (
        main(
            [
                "eval",
                "lm",
                "--model",
                str(dump / "checkpoint"),
                "--suite",
                "tiny_mc",
                "tiny_ppl",
                "--include-path",
                str(tasks),
                "--dtype",
                "fp32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    after = json.loads(out.read_text())["results"]
    assert bpb[4] == pytest.approx(after["tiny_ppl"]["bits_per_byte,none"], rel=1e-5)
    assert read_scalars(str(dump), "eval/tiny_mc/acc")[4] == pytest.approx(
        after["tiny_mc"]["acc,none"]
    )


@pytest.mark.slow
def test_two_process_training_splits_synthetic_items_over_ranks(tmp_path):
    dump = tmp_path / "run"
    run_training(
        2,
        [
            "--metrics.log_freq",
            "1",
            "--job.dump_folder",
            str(dump),
            "--training.steps",
            "4",
            "--checkpoint.enable",
            "--eval.every",
            "4",
            "--eval.synthetic",
            "true",
            "--eval.ranks",
            "all",
            "--eval.synthetic_count",
            "10",
            "--eval.dtype",
            "fp32",
        ],
        config=DEPO,
    )
    items = read_scalars(str(dump), "eval/depo1/items")
    accuracy = read_scalars(str(dump), "eval/depo1/accuracy")
    assert items == {4: 10.0 * 2} and 4 in accuracy  # groups k=1, k=2 (K = 2)
    run = load(dump / "run_config.toml", environment=False)
    reference = evaluate_synthetic(run, dump / "checkpoint", count=10)
    assert accuracy[4] == pytest.approx(reference["overall"]["accuracy"])


def _peak_rss_growth(work):
    """(what ``work()`` returns, the bytes by which this process's peak resident memory grew while
    it ran): Linux's high-water mark, reset first (``/proc/self/clear_refs``), against the memory
    before."""

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    result = work()
    return result, status("VmHWM") - before


def _gather_on_four_ranks(rank, port, out, queue):
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="4",
        LOCAL_WORLD_SIZE="4",
        OMP_NUM_THREADS="1",
    )
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from canon_titan.config.build import build_trainer_config
    from canon_titan.evaluation.in_training import EvalSettings
    from canon_titan.tools import runtime
    from canon_titan.trainer import CanonTrainer

    CanonTrainer.takes_stop_signals = False
    runtime.apply()
    try:
        run = load(
            CONFIGS["llama"],
            [
                "--model.dim",
                "512",
                "--model.ffn_hidden_dim",
                "1536",
                "--training.seq_len",
                "32",
                "--training.local_batch_size",
                "2",
                "--checkpoint.enable",
                "false",
                "--metrics.enable_tensorboard",
                "false",
                "--job.dump_folder",
                f"{out}/run",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "2",
            ],
            environment=False,
        )
        trainer = build_trainer_config(run).build()
        settings = EvalSettings(
            every=1,
            tasks=[],
            synthetic=False,
            synthetic_count=0,
            limit=None,
            ranks="first",
            max_seconds=60,
            dtype="fp32",
            batch_size=1,
            data_dir=None,
            include_path=[],
        )
        evaluator = InTrainingEval(settings, trainer.parallel_dims, trainer.device, total_steps=1)
        state, grown = _peak_rss_growth(lambda: evaluator._full_state(trainer.model_parts))
        # The reference: this stage's weights as torch gathers a full state dict.
        stage = {
            k: v.detach().clone()
            for part in trainer.model_parts
            for k, v in get_model_state_dict(
                part, options=StateDictOptions(full_state_dict=True)
            ).items()
        }
        torch.save(stage, f"{out}/stage-{rank}.pt")
        if rank == 0:
            torch.save(state, f"{out}/gathered.pt")
        queue.put(
            (
                rank,
                grown,
                sum(t.nbytes for t in stage.values()),
                max(t.nbytes for t in stage.values()),
            )
        )
        evaluator.close()
        trainer.close()
    except Exception as e:
        queue.put((rank, repr(e), 0, 0))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_gathering_the_weights_under_pp_and_fsdp_allocates_what_each_rank_must_hold(
    tmp_path, monkeypatch
):
    """Four gloo ranks, PP 2 x FSDP 2: rank 0 gathers every weight (equal to each stage's full
    state dict as torch gathers it), its peak memory growing by about the model once; the second
    stage's first rank and the ranks that lead no stage grow by about their largest weight twice
    (one gathered weight, and gloo's buffer for it), not by a stage. At 381a133 ``gather_object``
    padded every rank's object to the largest and allocated that times the world on rank 0 (5 times
    the model here), and every rank held its whole stage."""
    # Every block of 64 KiB or more mapped on its own and unmapped when freed, so that the resident
    # memory's peak is the live blocks' (glibc otherwise keeps freed blocks below a threshold that
    # it raises).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_gather_on_four_ranks, args=(r, port, str(tmp_path), queue))
        for r in range(4)
    ]
    for p in procs:
        p.start()
    results = {
        rank: (grown, stage, largest)
        for rank, grown, stage, largest in (queue.get(timeout=900) for _ in procs)
    }
    for p in procs:
        p.join(timeout=60)
    assert all(isinstance(r[0], int) for r in results.values()), results
    gathered = torch.load(tmp_path / "gathered.pt")
    reference = {**torch.load(tmp_path / "stage-0.pt"), **torch.load(tmp_path / "stage-2.pt")}
    assert gathered.keys() == reference.keys() and all(
        torch.equal(gathered[k], reference[k]) for k in reference
    )
    model = sum(t.nbytes for t in reference.values())
    slack = 8 * 2**20  # the allocator's and gloo's own buffers, Python objects
    grown, _, largest = results[0]
    assert grown <= model + 2 * largest + slack, (grown, model, largest)
    for rank in (1, 2, 3):
        grown, stage, largest = results[rank]
        assert stage > 2 * largest + slack  # the bound below tells a stage from a weight
        assert grown <= 2 * largest + slack, (rank, grown, stage, largest, results)


@pytest.mark.slow
def test_a_stop_signal_during_a_long_evaluation_saves_the_step_and_the_resumed_run_evaluates_it(
    tmp_path,
):
    """SIGTERM while the evaluation of step 2 scores items far longer than the stop's grace period:
    the evaluation stops at its next item, step 2 is saved and the job exits 75; the resumed run
    evaluates step 2's weights before its first step. At 381a133 the evaluation ran on, the grace
    period ran out and the job exited 3 with nothing saved."""
    dump = tmp_path / "run"

    def command(count):
        return [
            sys.executable,
            "-m",
            "canon_titan.cli",
            "train",
            "--config",
            str(DEPO),
            "--nproc",
            "1",
            "--training.steps",
            "4",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "2",
            "--metrics.log_freq",
            "1",
            "--checkpoint.interval",
            "100",
            "--job.stop_grace_seconds",
            "30",
            "--eval.every",
            "2",
            "--eval.synthetic",
            "true",
            "--eval.synthetic_count",
            str(count),
            "--eval.max_seconds",
            "3600",
            "--eval.dtype",
            "fp32",
            "--job.dump_folder",
            str(dump),
        ]

    def sigterm_into_the_items(proc):
        time.sleep(3)
        os.kill(proc.pid, signal.SIGTERM)

    code, out = interrupt(command(5000), "[eval] step 2: evaluating", sigterm_into_the_items)
    assert code == 75, out[-4000:]
    assert "[eval] step 2: cut short by a stop signal" in out, out[-4000:]
    assert "preempted at step 2, checkpoint saved" in out, out[-4000:]
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()

    resumed = subprocess.run(
        command(2), cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600
    )
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert out.index("[eval] step 2: evaluating") < out.index("step:  3"), out[-4000:]
    assert "[eval] step 2: depo1/accuracy" in out and "[eval] step 4: depo1/accuracy" in out, out[
        -4000:
    ]
    assert read_scalars(str(dump), "eval/depo1/items")[4] == 2 * 2  # groups k=1, k=2 (K = 2)
