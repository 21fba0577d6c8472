"""What a new user following the README tripped over in issue 89 (round four), item by item: each
behaviour against what the user typed, a hand computation or what the library itself does."""

import logging
import math
import re
import time as real_time
import warnings

import pytest

from canon_titan.config import ConfigError, load, run_toml
from canon_titan.plan.gpus import GPUS
from conftest import CONFIGS, DEBUG_CONFIG, REPO

RECIPE = REPO / "train_configs" / "LlamaCanon-1B-Nemo-1T-lr0.003.toml"


def _shown(tmp_path, config, overrides=(), environment=True):
    """``config show``'s output for ``config``, as a file."""
    path = tmp_path / "shown.toml"
    path.write_text(run_toml(load(config, list(overrides), environment)))
    return path


def test_a_shown_config_given_another_flavor_builds_that_flavor(tmp_path):
    """Item 1: the README's ``config show llama_canon_debug.toml > my_run.toml``, then
    ``--model.flavor 1B``: the 1B shape (the 1B flavor's own numbers), not the debug shape under a
    1B label; without the change the copy resolves as the original, and a key set on show's command
    line stays pinned."""
    import model_registry

    shown = _shown(tmp_path, CONFIGS["llama_canon"])
    one_b = model_registry.family("llama_canon").FLAVORS["1B"]
    run = load(shown, ["--model.flavor", "1B"])
    assert (
        (run.model_args.dim, run.model_args.n_layers, run.model_args.n_heads)
        == (one_b.dim, one_b.n_layers, one_b.n_heads)
        == (2048, 24, 32)
    )
    assert load(shown).sections == load(CONFIGS["llama_canon"]).sections
    pinned = _shown(tmp_path, CONFIGS["llama_canon"], ["--model.n_layers", "3"])
    assert load(pinned, ["--model.flavor", "1B"]).model_args.n_layers == 3


def test_a_shown_config_writes_the_values_a_flavor_leaves_to_a_rule(tmp_path):
    """Item 9: ``config show --static`` of a 1B recipe: ``ffn_hidden_dim`` by the 8/3 rule rounded
    up to ``multiple_of`` (by hand: 8 x 2048 / 3 = 5461 -> 5632) and ``n_kv_heads`` = ``n_heads``
    (32), not ``unset``."""
    text = _shown(tmp_path, RECIPE, environment=False).read_text()
    hidden = 256 * math.ceil(int(8 * 2048 / 3) / 256)
    assert f"# ffn_hidden_dim = {hidden}" in text and hidden == 5632
    assert "# n_kv_heads = 32" in text and "ffn_hidden_dim = unset" not in text


def test_show_of_an_unedited_recipe_says_how_to_show_it(capsys):
    """Item 8: showing is not running: the error on a recipe's placeholder paths names ``--static``,
    which shows it."""
    from canon_titan import cli

    assert cli.main(["config", "show", str(RECIPE)]) == 2
    assert "config show --static shows it" in capsys.readouterr().err
    assert cli.main(["config", "show", "--static", str(RECIPE)]) == 0
    assert 'flavor = "1B"' in capsys.readouterr().out


def test_a_key_is_unset_from_the_command_line(tmp_path, capsys):
    """Item 12: a ``files`` config switched to ``stream`` on the command line, its ``dataset_path``
    unset there (the refusal names the way); ``'"unset"'`` is the string; a ``[model]`` key unset
    takes the flavor's value; name and flavor cannot be unset. ``--help`` and docs/configs.md say
    so."""
    from canon_titan import cli

    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    files = [
        "--dataloader.dataset",
        "files",
        "--dataloader.dataset_path",
        str(tmp_path / "*.jsonl"),
    ]
    stream = ["--dataloader.dataset", "stream", "--dataloader.sources", f'["{tmp_path}/*.jsonl"]']
    unset = r"dataset_path: is set.*--dataloader\.dataset_path unset"
    with pytest.raises(ConfigError, match=unset):
        load(DEBUG_CONFIG, files + stream)
    run = load(DEBUG_CONFIG, files + stream + ["--dataloader.dataset_path", "unset"])
    assert run["dataloader"]["dataset_path"] is None
    assert ("dataloader", "dataset_path") not in run.origins
    described = load(DEBUG_CONFIG, ["--job.description", '"unset"'])
    assert described["job"]["description"] == "unset"
    dropped = load(DEBUG_CONFIG, ["--job.description", "x", "--job.description", "unset"])
    assert dropped["job"]["description"] == ""
    debug = load(
        CONFIGS["llama_canon"], ["--model.ffn_hidden_dim", "100", "--model.ffn_hidden_dim", "unset"]
    )
    assert debug.model_args.ffn_hidden_dim == 384  # the debug flavor's
    for key in ("name", "flavor"):
        with pytest.raises(ConfigError, match="cannot be unset"):
            load(DEBUG_CONFIG, [f"--model.{key}", "unset"])
    with pytest.raises(ConfigError, match="stepz: unknown key"):
        load(DEBUG_CONFIG, ["--training.stepz", "unset"])
    with pytest.raises(SystemExit):
        cli.main(["config", "show", "--help"])
    assert "--section.key unset" in " ".join(capsys.readouterr().out.split())
    assert "--section.key unset" in (REPO / "docs" / "configs.md").read_text()


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("eps", "0.0", "[optimizer] eps: must be > 0, got 0.0"),
        ("weight_decay", "-0.1", "[optimizer] weight_decay: must be >= 0, got -0.1"),
    ],
)
def test_each_optimizer_key_states_its_own_rule(key, value, message):
    """Item 24: ``eps = 0`` and ``weight_decay = -0.1`` each get their own key's rule."""
    with pytest.raises(ConfigError) as refused:
        load(DEBUG_CONFIG, [f"--optimizer.{key}", value])
    assert str(refused.value).endswith(message) and "(eps > 0)" not in str(refused.value)


def test_a_warmup_longer_than_the_run_is_said_once_a_run(caplog, monkeypatch):
    """Item 20: the launcher checks the config and says the warmup is shortened; its workers
    (``CANON_TITAN_LAUNCH_CHECKED=1``, which ``canon-titan train`` sets for them) shorten it the
    same way without saying it again."""
    from canon_titan.config.titan_sections import CHECKED_ENV, titan_sections

    run = load(DEBUG_CONFIG, ["--training.steps", "2", "--lr_scheduler.warmup_steps", "10"])
    said = "warmup_steps (10) is longer than the schedule's 2 steps"
    for checked, times in (("0", 1), ("1", 0)):
        monkeypatch.setenv(CHECKED_ENV, checked)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert titan_sections(run)["lr_scheduler"].warmup_steps == 2
        assert sum(said in r.getMessage() for r in caplog.records) == times, checked


def test_a_warmup_longer_than_the_run_is_the_warmup_torchtitan_logs(caplog):
    """Item 20: warmup 10 in a 2-step run: the config TorchTitan logs as the run's ("total steps
    2 (warmup N)") has the 2 steps it warms up over, with TorchTitan's own schedule: the learning
    rates of the clipped config equal those TorchTitan builds from the unclipped one."""
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer

    from canon_titan.config.titan_sections import titan_sections

    run = load(DEBUG_CONFIG, ["--training.steps", "2", "--lr_scheduler.warmup_steps", "10"])
    with caplog.at_level(logging.WARNING):
        schedule = titan_sections(run)["lr_scheduler"]
    assert schedule.warmup_steps == 2
    said = "warmup_steps (10) is longer than the schedule's 2 steps"
    assert any(said in r.getMessage() for r in caplog.records)

    def lrs(config) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        schedulers = config.build(optimizers=[optimizer], training_steps=2)
        out = []
        for _ in range(2):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedulers.step()
        return out

    unclipped = LRSchedulersContainer.Config(**run["lr_scheduler"])
    assert lrs(schedule) == lrs(unclipped)


def test_data_tokenize_uses_the_built_in_tokenizer_by_default(tmp_path, capsys):
    """Item 11: without ``--tokenizer`` the shards are the built-in tokenizer's, as
    ``[tokenizer] path`` defaults to it; another kind without its file is one line."""
    from canon_titan import cli
    from canon_titan.cli.common import BUILTIN_TOKENIZER
    from canon_titan.data.pretokenize import read_index

    (tmp_path / "a.jsonl").write_text('{"text": "Mia lived in a small house."}\n')
    tokenize = ["data", "tokenize", "--input", str(tmp_path / "a.jsonl")]
    assert cli.main([*tokenize, "--out", str(tmp_path / "t"), "--workers", "1"]) == 0
    assert read_index(tmp_path / "t")["tokenizer"]["path"] == str(BUILTIN_TOKENIZER.resolve())
    capsys.readouterr()
    assert (
        cli.main([*tokenize, "--out", str(tmp_path / "u"), "--tokenizer-kind", "sentencepiece"])
        == 2
    )
    assert "--tokenizer-kind sentencepiece needs --tokenizer" in capsys.readouterr().err


def test_a_parquet_file_with_damaged_pages_is_one_line_and_leaves_nothing(tmp_path, capsys):
    """Item 23: a Parquet file whose second row group's compressed pages are damaged (its footer
    intact): one line naming the file, exit 2, no shard or temporary file in the output folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from canon_titan import cli

    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.table({"text": [f"document {i} " * 20 for i in range(2000)]}),
        path,
        compression="snappy",
        row_group_size=500,
    )
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    for i in range(start + 40, start + column.total_compressed_size - 8):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    out = tmp_path / "tokens"
    assert (
        cli.main(["data", "tokenize", "--input", str(path), "--out", str(out), "--workers", "1"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "damaged Parquet data" in err[0], err
    assert list(out.iterdir()) == []


def test_a_streamed_mixture_says_its_weights_and_what_each_source_supplied(tmp_path, caplog):
    """Item 13: two sources at equal weights, one of short documents and one of long: the start
    says the weights; the shares are the tokens of the documents each reader has read so far (the
    reader's own position, tokenized here), not the weights; with loader workers the units' counts
    add up to at least the tokens the batches hold."""
    import json

    from canon_titan.data.builtin import ASSET_DIR
    from canon_titan.data.tokenizers import build_tokenizer
    from test_real_data import stream_loader

    short, long = tmp_path / "short", tmp_path / "long"
    short.mkdir(), long.mkdir()
    texts = {
        short: [f"Mia {i}." for i in range(400)],
        long: [f"Mia lived in house {i}. " * 12 for i in range(400)],
    }
    for folder, docs in texts.items():
        (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    with caplog.at_level(logging.INFO):
        loader = stream_loader(
            [short / "*", long / "*"], workers=0, shuffle_buffer=1, weights=[1.0, 1.0]
        )
    assert any(f"{short}/* 50%, {long}/* 50%" in r.getMessage() for r in caplog.records)
    batches = [batch for _, batch in zip(range(6), loader)]
    assert all(set(inputs) == {"input"} for inputs, _ in batches)  # the counts are taken off
    tokenizer = build_tokenizer("hf", str(ASSET_DIR))
    read = [
        sum(
            len(tokenizer.encode(t, add_bos=True, add_eos=True))
            for t in texts[folder][: reader.line]
        )
        for folder, reader in zip((short, long), loader.dataset.readers)
    ]
    metrics, line = loader.mixture()
    shares = [metrics[f"data/source_{i}_token_share"] for i in range(2)]
    assert shares == pytest.approx([n / sum(read) for n in read])
    assert shares[1] > 0.8  # equal weights, long documents: most of the tokens
    assert f"({sum(read):,})" in line and "(weight 50%)" in line

    workers = stream_loader(
        [short / "*", long / "*"], workers=2, batch=2, seq_len=64, weights=[1.0, 1.0]
    )
    held = sum(
        inputs["input"].numel() + labels[:, -1:].numel()
        for inputs, labels in [batch for _, batch in zip(range(6), workers)]
    )
    metrics, line = workers.mixture()
    assert sum(metrics.values()) == pytest.approx(1.0)
    assert int(re.search(r"\(([\d,]+)\)", line).group(1).replace(",", "")) >= held


def test_the_eta_leaves_out_the_first_steps_compile():
    """Item 21: a first step of 100 s (compile, tuning), then 2 s a step: at step 3 of 10 the ETA
    is 7 x 2 s (the old extrapolation from the start: 104 / 3 x 7 = 243 s); at step 1 it is not
    guessed."""
    from canon_titan.components.progress import Progress

    now = [0.0]
    progress = Progress(10, clock=lambda: now[0])
    progress.step_starts()
    now[0] = 100.0
    progress.step_done(1)
    assert "ETA ? (estimated from step 2 on" in progress.line(1)
    for step in (2, 3):
        progress.step_starts()
        now[0] += 2.0
        progress.step_done(step)
    assert progress.line(3) == "progress: step 3/10 (30%), elapsed 0:01:44, ETA 0:00:14"
    assert progress.line(10).endswith("ETA 0:00:00")


def test_a_resume_loads_the_schedule_without_torchs_get_lr_warning():
    """Item 16: TorchTitan's schedulers, loaded as a resume loads them, warn (torch's
    ``get_last_lr()`` warning: the cause); the run's (``[lr_scheduler]``'s config) do not, and set
    the same last learning rate as the schedule stepped to that step."""
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer

    from canon_titan.components.lr_schedule import GET_LR_WARNING
    from canon_titan.config.titan_sections import titan_sections

    run = load(DEBUG_CONFIG, ["--training.steps", "10"])
    config = titan_sections(run)["lr_scheduler"]

    def schedulers(kind):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return optimizer, kind.build(optimizers=[optimizer], training_steps=10)

    optimizer, stepped = schedulers(config)
    for _ in range(3):
        optimizer.step()
        stepped.step()
    state = stepped.state_dict()
    titans = LRSchedulersContainer.Config(**run["lr_scheduler"])
    for kind, warned in ((titans, True), (config, False)):
        _, loaded = schedulers(kind)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded.load_state_dict(state)
        assert any(GET_LR_WARNING in str(w.message) for w in caught) == warned
        assert loaded.schedulers[0].get_last_lr() == stepped.schedulers[0].get_last_lr()


def test_an_evaluation_outside_a_git_checkout_prints_no_git_error(tmp_path, monkeypatch, capfd):
    """Item 18: lm-eval asks git for the current directory's commit; canon-titan's evaluation, run
    outside any checkout, does not let git print ``fatal: not a git repository``."""
    from canon_titan.config import load as load_run
    from canon_titan.convert.hf import to_hf
    from canon_titan.evaluation.lm import evaluate, load_hf_folder
    from conftest import make_checkpoint, write_tiny_tasks

    run, step, _ = make_checkpoint(tmp_path, [])
    to_hf(step, tmp_path / "hf", load_run(CONFIGS["llama_canon"], [], environment=False))
    (tmp_path / "tasks").mkdir()
    write_tiny_tasks(tmp_path / "tasks", [])
    model, tokenizer, _ = load_hf_folder(tmp_path / "hf", "fp32")
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    capfd.readouterr()
    result = evaluate(
        model,
        tokenizer,
        ["tiny_mc"],
        max_length=64,
        limit=2,
        include_paths=[str(tmp_path / "tasks")],
    )
    assert "tiny_mc" in result["results"]
    assert "not a git repository" not in "".join(capfd.readouterr())


# ---------------------------------------------------------------------------------- plan --search


def _fake_search(
    monkeypatch, own_s: float, own_fits: bool = True, others_fit: bool = True, sleep_s: float = 0.0
):
    """``plan --search`` of the debug config on 8 GPUs on a simulated clock: the config's own plan
    takes ``own_s`` (and ``sleep_s`` of real time), a probe 1 s, a full plan 60 s."""
    from canon_titan.plan import search as search_module
    from test_plan_search import _Clock, _fake_planner

    clock, planned = _Clock(), []
    fake = _fake_planner(clock, planned, 1.0, 60.0)

    def figures(config, overrides, *args):
        own = not {"--parallelism.data_parallel_shard_degree", "--model.n_layers"} & set(overrides)
        if own:
            clock.now += own_s - 60.0
            real_time.sleep(sleep_s)
        out = fake(config, overrides, *args)
        return dict(out, fits=own_fits if own else others_fit)

    monkeypatch.setattr(search_module, "time", clock)
    monkeypatch.setattr(search_module, "_plan_figures", figures)
    return planned


SEQ = ["--training.seq_len", "128"]
SEARCH = [str(CONFIGS["llama"]), "--gpus", "8", "--gpu", "h100", "--search", "--workers", "1", *SEQ]


def test_a_search_whose_own_plan_spent_the_budget_says_so_and_writes_the_own_layout(
    monkeypatch, tmp_path, capsys
):
    """Item 4, the issue's run: the config's own plan takes 533 s of the 580 s budget. The search
    says the budget ran out (what the own plan took of it, the --budget-s to try), not that nothing
    fits; ``--write`` writes the config's own layout, which fits, and the exit status is 0."""
    from canon_titan.cli.plan import main

    _fake_search(monkeypatch, 533.0)
    out = tmp_path / "own.toml"
    assert main([*SEARCH, "--budget-s", "580", "--write", str(out)]) == 0
    printed = capsys.readouterr()
    assert "No layout found that fits" not in printed.out
    assert re.search(
        r"The budget ran out before another layout was planned in full \(--budget-s "
        r"580, of which the config's own plan took 533 s\); the config's own layout "
        r"above fits: raise --budget-s \(--budget-s 1160\)",
        printed.out,
    ), printed.out
    assert re.search(r"not probed \(budget\)", printed.out)
    assert "wrote the config's own layout" in printed.err
    written = load(out, [], environment=False)
    assert written["parallelism"] == load(CONFIGS["llama"], SEQ, environment=False)["parallelism"]


@pytest.mark.parametrize("own_s,others_fit,code", [(533.0, True, 3), (60.0, False, 1)])
def test_a_search_exits_3_when_its_budget_ran_out_and_1_when_nothing_fits(
    monkeypatch, capsys, own_s, others_fit, code
):
    """Item 4: the own layout does not fit; the budget runs out before any other is planned (exit
    3: a larger budget may find one), or every layout tried does not fit (exit 1); ``--write``
    writes nothing either way."""
    from canon_titan.cli.plan import main

    _fake_search(monkeypatch, own_s, own_fits=False, others_fit=others_fit)
    budget = "580" if code == 3 else "7200"
    assert main([*SEARCH, "--budget-s", budget, "--write", "x.toml"]) == code
    printed = capsys.readouterr()
    assert ("No layout found that fits" in printed.out) == (code == 1)
    assert "nothing written" in printed.err and not (REPO / "x.toml").exists()


def test_a_search_says_every_30_s_what_it_still_plans(monkeypatch):
    """Item 4: the config's own plan, running (here 0.3 s of real time against a heartbeat of
    0.05 s), is said to be running while it runs, not only when it starts."""
    from canon_titan.plan import search as search_module

    _fake_search(monkeypatch, 60.0, sleep_s=0.3)
    monkeypatch.setattr(search_module, "HEARTBEAT_S", 0.05)
    said = []
    search_module.search(
        str(CONFIGS["llama"]),
        SEQ,
        gpus=8,
        gpu=GPUS["h100"],
        top=3,
        budget_s=200.0,
        workers=1,
        pipelines=False,
        progress=said.append,
    )
    beats = [s for s in said if s.startswith("planning the config's own layout:")]
    assert len(beats) >= 2 and all(s.endswith(" s so far") for s in beats), said[:10]


def _library_notes() -> None:
    torchao = logging.getLogger("torchao")
    torchao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    torchao.warning("kept note")


def test_search_workers_drop_the_library_notes_the_programs_drop(capfd):
    """Item 22: a planning worker process (spawned) drops torchao's failed-load note, as a
    canon-titan program does, and keeps torchao's other records."""
    from canon_titan.plan.search import _Pool

    pool = _Pool(2)
    try:
        pool._pool.submit(_library_notes).result(timeout=120)
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert "kept note" in err and "Failed to load" not in err


def test_a_search_whose_probes_find_nothing_that_fits_probes_on_into_the_budget(monkeypatch):
    """Item 4, the page's command as it ran on 2026-12-01 (load 6): every layout probed in the
    probes' share of the budget needed more memory than the GPU's, and the search ended with 212 s
    of its 580 unused and nothing planned but the config's own. Simulated (the own plan 60 s, a
    probe 10 s, a full plan 60 s; without activation checkpointing no layout fits), budget 290: by
    hand, six of the seven layouts without checkpointing are probed, two a chunk of 40 s, by 180 s,
    past the probes' share (174 s), where the search stopped; it probes on to the next chunk (ends
    220 s, the chunk began before 290 - 60 - 40), finds a layout that fits with selective
    checkpointing and plans it in full (ends 280 s)."""
    from canon_titan.plan import search as search_module
    from test_plan_search import _Clock

    clock = _Clock()

    def figures(config, overrides, *args):
        value = {
            flag: overrides[i + 1] for i, flag in enumerate(overrides) if flag.startswith("--")
        }
        probe = "--model.n_layers" in value
        clock.now += 10.0 if probe else 60.0
        checkpointed = value.get("--activation_checkpoint.mode", "none") != "none"
        memory = (10 if checkpointed else 100) * 2**30
        return {
            "fits": memory < 80 * 2**30,
            "device_bytes": memory,
            "live_bytes": memory,
            "step_s": 1.0,
            "tokens_per_s_per_gpu": 1e4,
            "mfu": 0.5,
            "gpu_hours": 1.0,
            "accumulation": 1,
            "seconds": 10.0 if probe else 60.0,
        }

    monkeypatch.setattr(search_module, "time", clock)
    monkeypatch.setattr(search_module, "_plan_figures", figures)
    found = search_module.search(
        str(CONFIGS["llama"]),
        SEQ,
        gpus=8,
        gpu=GPUS["h100"],
        top=3,
        budget_s=290.0,
        workers=1,
        pipelines=False,
    )
    assert found.tried["probed"] == 8 and found.seconds <= 290.0
    assert [o.layout.ac for o in found.ranked] == ["selective"]
