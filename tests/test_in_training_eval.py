"""Evaluation during training ([eval]): config checks, the evaluator in one process against the
standalone scorers, and 2-process CPU trainings whose eval scalars land in TensorBoard and equal
`canon-titan eval lm / eval synthetic` run afterwards on the final checkpoint."""

import json
import types

import pytest
import torch

from canon_titan.cli import main
from canon_titan.components.metrics import read_scalars
from canon_titan.config import ConfigError, load
from canon_titan.config.build import _eval_settings
from canon_titan.evaluation.in_training import InTrainingEval
from canon_titan.evaluation.synthetic import evaluate as evaluate_synthetic
from conftest import COMMON, CONFIGS, REPO, run_training, write_tiny_tasks

DEPO = REPO / "train_configs" / "playground" / "depo.toml"


@pytest.mark.parametrize("overrides,key,message", [
    (["--eval.every", "2"], "[eval] every", "nothing to evaluate"),
    (["--eval.every", "2", "--eval.synthetic", "true"], "[eval] synthetic", "needs a synthetic [dataloader] dataset"),
    (["--eval.every", "-1"], "[eval] every", "must be >= 0"),
    (["--eval.every", "2", "--eval.tasks", '["x"]', "--eval.limit", "-1"], "[eval] limit", "must be >= 0"),
])
def test_eval_section_errors_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        load(CONFIGS["llama_canon"], overrides, environment=False)
    assert key in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("limit,passed", [(0, None), (7, 7)])
def test_limit_zero_scores_every_item(limit, passed):
    """``limit = 0`` (the release recipes' full evaluation) reaches lm-eval as its "no limit"."""
    run = load(CONFIGS["llama_canon"], ["--eval.every", "2", "--eval.tasks", '["x"]', "--eval.limit", str(limit)],
               environment=False)
    assert _eval_settings(run, "").limit == passed


def _single_process_eval(run, max_seconds):
    settings = _eval_settings(run, str(REPO / "canon_titan" / "assets" / "builtin"))
    settings.max_seconds = max_seconds
    dims = types.SimpleNamespace(pp_enabled=False, pp=1)
    return InTrainingEval(settings, dims, torch.device("cpu"), total_steps=10)


def test_synthetic_scores_equal_the_standalone_scorer_and_respect_the_time_limit(tmp_path):
    from conftest import make_checkpoint

    overrides = ["--eval.every", "5", "--eval.synthetic", "true", "--eval.synthetic_count", "6",
                 "--eval.dtype", "fp32", "--training.steps", "10"]
    run, step, model = make_checkpoint(tmp_path, overrides, config=DEPO, seed=1)
    evaluator = _single_process_eval(run, max_seconds=600)
    assert [s for s in range(1, 11) if evaluator.due(s)] == [5, 10]
    metrics = evaluator.run([model], step=5)
    reference = evaluate_synthetic(run, step, count=6)
    assert metrics["eval/depo1/items"] == reference["overall"]["total"] == 6 * 2  # groups k=1, k=2 (K = 2)
    assert metrics["eval/depo1/accuracy"] == reference["overall"]["accuracy"]
    for group, g in reference["groups"].items():
        assert metrics[f"eval/depo1/{group}"] == g["accuracy"]

    hurried = _single_process_eval(run, max_seconds=1e-9).run([model], step=5)
    assert hurried["eval/depo1/items"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    [],  # FSDP over both ranks: rank 0 gathers the full weights
    ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
], ids=["fsdp", "pp"])
def test_two_process_training_logs_lm_eval_scores_equal_to_eval_lm(tmp_path, layout):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tiny_tasks(tasks, [{"q": "Count: 1, 2,", "a": " 3"}])
    dump = tmp_path / "run"
    run_training(2, COMMON + layout + [
        "--job.dump_folder", str(dump), "--training.steps", "4", "--checkpoint.enable", "--eval.every", "2",
        "--eval.tasks", '["tiny_mc", "tiny_ppl"]', "--eval.include_path", f'["{tasks}"]', "--eval.dtype", "fp32",
    ], config=CONFIGS["llama_canon"])
    bpb = read_scalars(str(dump), "eval/tiny_ppl/bits_per_byte")
    assert sorted(bpb) == [2, 4]
    assert sorted(read_scalars(str(dump), "eval/tiny_mc/acc")) == [2, 4]
    assert bpb[2] != bpb[4]  # the weights changed between the two evaluations

    out = tmp_path / "after.json"
    assert main(["eval", "lm", "--model", str(dump / "checkpoint"), "--suite", "tiny_mc", "tiny_ppl",
                 "--include-path", str(tasks), "--dtype", "fp32", "--out", str(out)]) == 0
    after = json.loads(out.read_text())["results"]
    assert bpb[4] == pytest.approx(after["tiny_ppl"]["bits_per_byte,none"], rel=1e-5)
    assert read_scalars(str(dump), "eval/tiny_mc/acc")[4] == pytest.approx(after["tiny_mc"]["acc,none"])


@pytest.mark.slow
def test_two_process_training_splits_synthetic_items_over_ranks(tmp_path):
    dump = tmp_path / "run"
    run_training(2, ["--metrics.log_freq", "1", "--job.dump_folder", str(dump), "--training.steps", "4",
                     "--checkpoint.enable", "--eval.every", "4", "--eval.synthetic", "true", "--eval.ranks", "all",
                     "--eval.synthetic_count", "10", "--eval.dtype", "fp32"], config=DEPO)
    items = read_scalars(str(dump), "eval/depo1/items")
    accuracy = read_scalars(str(dump), "eval/depo1/accuracy")
    assert items == {4: 10.0 * 2} and 4 in accuracy  # groups k=1, k=2 (K = 2)
    run = load(dump / "run_config.toml", environment=False)
    reference = evaluate_synthetic(run, dump / "checkpoint", count=10)
    assert accuracy[4] == pytest.approx(reference["overall"]["accuracy"])
