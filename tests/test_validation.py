"""Held-out validation during training (``[validation]``): where each dataset kind's held-out data
comes from and that training never reads it, the same windows at every validation, the refusals
before launch, and, on real gloo ranks, that the logged validation loss is the mean token loss of
the held-out windows under the checkpoint of its step, computed by hand in one process, on every
layout, and that a resumed run continues the curve."""

import json
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from canon_titan.config import ConfigError, load
from canon_titan.config.build import build_trainer_config
from canon_titan.data.builtin import (
    ASSET_DIR,
    CORPUS_FILE,
    HELD_OUT_FILE,
    NUM_STORIES,
    generate_corpus,
)
from canon_titan.data.pretokenize import tokenize_files
from canon_titan.data.tokenizers import build_tokenizer
from conftest import CONFIGS, DEBUG_CONFIG, REPO, free_port, made_once

SEQ = 64
DEPO = REPO / "train_configs" / "playground" / "depo.toml"


def _tokenized(folder, parts, stories, seed, kind="hf", tokenizer_path=ASSET_DIR):
    """``parts`` files of ``stories`` distinct stories each, tokenized into ``folder/tokens``."""
    (folder / "src").mkdir()
    texts = generate_corpus(parts * stories, seed=seed)
    for i in range(parts):
        rows = texts[i * stories : (i + 1) * stories]
        (folder / "src" / f"part{i}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in rows)
        )
    tokenize_files(
        str(folder / "src" / "*.jsonl"),
        folder / "tokens",
        kind=kind,
        tokenizer_path=str(tokenizer_path),
        log=lambda m: None,
    )
    return folder / "tokens"


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory):
    """Four shards of distinct stories, tokenized with the built-in tokenizer."""
    made = made_once(tmp_path_factory, "validation_tokens", lambda f: _tokenized(f, 4, 60, seed=5))
    return made / "tokens"


def _tokens_run(folder, *overrides):
    return load(
        DEBUG_CONFIG,
        [
            "--dataloader.dataset",
            "tokens",
            "--dataloader.dataset_path",
            str(folder),
            "--training.seq_len",
            str(SEQ),
            "--training.local_batch_size",
            "2",
            *overrides,
        ],
    )


def _loaders(run):
    """The training loader and the held-out loader a run builds (one data-parallel rank)."""
    config = build_trainer_config(run)
    kwargs = {
        "dp_world_size": 1,
        "dp_rank": 0,
        "tokenizer": build_tokenizer("hf", str(ASSET_DIR)),
        "seq_len": SEQ,
        "local_batch_size": 2,
    }
    return config.dataloader.build(**kwargs), config.validator.dataloader.build(**kwargs)


def _windows(stream: np.ndarray) -> list[tuple]:
    return [tuple(stream[k * SEQ : k * SEQ + SEQ + 1]) for k in range((len(stream) - 1) // SEQ)]


def _rows(batch) -> list[tuple]:
    inputs, labels = batch
    return [tuple(np.append(x.numpy(), y[-1].item())) for x, y in zip(inputs["input"], labels)]


def test_a_held_out_fraction_of_the_shards_is_never_trained_on(token_folder):
    """``held_out_fraction = 0.25`` of 4 shards holds out ceil(0.25 x 4) = 1 shard, the middle one
    of the folder's order (shard 2, spread evenly): the held-out loader reads its windows and only
    them, the training loader every window of the other three over an epoch and none of it."""
    index = json.loads((token_folder / "index.json").read_text())
    shards = {
        s["shard"]: np.fromfile(token_folder / s["shard"], dtype=index["dtype"]).astype(np.int64)
        for s in index["shards"]
    }
    assert len(shards) == 4
    run = _tokens_run(token_folder, "--validation.enable", "--validation.held_out_fraction", "0.25")
    train, held_out = _loaders(run)

    expected_held_out = _windows(shards["00002.bin"])
    expected_train = _windows(
        np.concatenate([shards[n] for n in ("00000.bin", "00001.bin", "00003.bin")])
    )
    read_held_out = [row for batch in held_out for row in _rows(batch)]
    assert (
        read_held_out == expected_held_out[: len(expected_held_out) // 2 * 2]
    )  # in order, whole batches
    epoch, batches = [], iter(train)
    while len(epoch) < len(expected_train) // 2 * 2:  # the first epoch's whole batches
        epoch += _rows(next(batches))
    assert len(set(epoch)) == len(epoch) and set(epoch) <= set(expected_train)
    assert not set(epoch) & set(read_held_out)
    assert (
        "held out for validation" in json.loads(train.fingerprint)[str(token_folder / "00002.bin")]
    )


def test_the_built_in_held_out_split_is_not_in_the_corpus():
    """The split is the generator's next stories after the corpus's, and none of them is in it."""

    def texts(name):
        return [json.loads(line)["text"] for line in (ASSET_DIR / name).read_text().splitlines()]

    held_out, corpus = texts(HELD_OUT_FILE), texts(CORPUS_FILE)
    assert held_out == generate_corpus(NUM_STORIES + len(held_out))[NUM_STORIES:]
    assert held_out and not set(held_out) & set(corpus)


@pytest.mark.parametrize(
    "config, overrides",
    [
        (DEBUG_CONFIG, []),
        (DEPO, ["--validation.steps", "3"]),
        (
            DEBUG_CONFIG,
            [
                "--dataloader.dataset",
                "stream",
                "--dataloader.sources",
                f"['{ASSET_DIR / CORPUS_FILE}']",
                "--validation.sources",
                f"['{ASSET_DIR / HELD_OUT_FILE}']",
                "--validation.steps",
                "3",
            ],
        ),
    ],
    ids=["builtin", "depo1", "stream"],
)
def test_every_validation_reads_the_same_windows(config, overrides):
    from canon_titan.components.validation import HeldOutBatches

    run = load(config, ["--training.seq_len", str(SEQ), "--validation.enable", *overrides])
    config = build_trainer_config(run).validator
    steps = config.steps if config.steps != -1 else 4
    batches = HeldOutBatches(
        config.dataloader,
        steps,
        dp_world_size=2,
        dp_rank=1,
        seq_len=SEQ,
        local_batch_size=2,
        tokenizer=build_tokenizer("hf", str(ASSET_DIR)),
    )
    first = [(x["input"].clone(), y.clone()) for x, y in batches]
    second = list(batches)
    assert len(first) == len(second) == steps
    for (a, la), (b, lb) in zip(first, second):
        assert torch.equal(a, b["input"]) and torch.equal(la, lb)


def test_the_release_recipes_keep_validation_off():
    """The release's ``validation: null``."""
    recipes = sorted((REPO / "train_configs").glob("*-Nemo-*.toml"))
    assert recipes and not [
        p.name for p in recipes if load(p, environment=False)["validation"]["enable"]
    ]


@pytest.fixture(scope="module")
def other_tokenizer_folder(tmp_path_factory):
    """Held-out documents tokenized with another tokenizer (a SentencePiece model of 320 ids)."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("other")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(generate_corpus(300, seed=3)),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=320,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return _tokenized(
        folder, 1, 20, seed=8, kind="sentencepiece", tokenizer_path=folder / "tokenizer.model"
    )


def refusal(run_overrides) -> tuple[str, str]:
    with pytest.raises(ConfigError) as e:
        run_overrides()
    return e.value.key, e.value.message


def test_bad_held_out_data_is_refused_before_launch(token_folder, other_tokenizer_folder, tmp_path):
    missing = str(tmp_path / "nothing")
    assert refusal(
        lambda: _tokens_run(
            token_folder, "--validation.enable", "--validation.dataset_path", missing
        )
    ) == ("[validation] dataset_path", f"{missing!r} does not exist")
    files = [
        "--dataloader.dataset",
        "files",
        "--dataloader.dataset_path",
        str(ASSET_DIR / CORPUS_FILE),
    ]
    assert refusal(
        lambda: load(
            DEBUG_CONFIG,
            [*files, "--validation.enable", "--validation.dataset_path", f"{missing}/*.jsonl"],
        )
    ) == ("[validation] dataset_path", f"'{missing}/*.jsonl' matches no file")
    stream = [
        "--dataloader.dataset",
        "stream",
        "--dataloader.sources",
        f"['{ASSET_DIR / CORPUS_FILE}']",
    ]
    assert refusal(
        lambda: load(
            DEBUG_CONFIG,
            [
                *stream,
                "--validation.enable",
                "--validation.steps",
                "2",
                "--validation.sources",
                f"['{missing}*.jsonl']",
            ],
        )
    ) == ("[validation] sources", f"'{missing}*.jsonl' matches no file")
    key, message = refusal(
        lambda: _tokens_run(token_folder, "--validation.held_out_fraction", "0.8")
    )
    assert key == "[validation] held_out_fraction" and "of the 4 shard(s)" in message
    assert "holds out 4, which leaves no training data" in message
    key, message = refusal(
        lambda: _tokens_run(
            token_folder,
            "--validation.enable",
            "--validation.dataset_path",
            str(other_tokenizer_folder),
        )
    )
    assert (
        key == "[validation] dataset_path"
        and "was tokenized with a sentencepiece tokenizer of 320 ids" in message
    )
    assert "the run with a hf tokenizer of" in message


@pytest.mark.parametrize(
    "config, overrides, key, message",
    [
        (
            DEBUG_CONFIG,
            ["--validation.dataset_path", "x"],
            "[validation] dataset_path",
            "dataset = 'builtin' validates on its held-out split",
        ),
        (
            DEBUG_CONFIG,
            ["--validation.steps", "2", "--validation.tokens", "100"],
            "[validation] tokens",
            "set one of them",
        ),
        (DEBUG_CONFIG, ["--validation.every", "0"], "[validation] every", "must be >= 1"),
        (
            DEPO,
            ["--validation.enable"],
            "[validation] steps",
            "dataset = 'depo1' is endless: set steps or tokens",
        ),
        (
            DEPO,
            ["--validation.seed", "777"],
            "[validation] seed",
            "the training stream's [dataloader] seed",
        ),
        (
            DEBUG_CONFIG,
            [
                "--dataloader.dataset",
                "files",
                "--dataloader.dataset_path",
                str(ASSET_DIR / CORPUS_FILE),
                "--validation.enable",
            ],
            "[validation] dataset_path",
            "validates on held-out data of its own: set dataset_path",
        ),
    ],
)
def test_impossible_validation_settings(config, overrides, key, message):
    k, m = refusal(lambda: load(config, overrides))
    assert k == key and message in m, (k, m)


def test_canon_titan_train_says_one_line_and_launches_nothing(tmp_path, monkeypatch, capsys):
    from canon_titan import cli
    from canon_titan.cli import train as cli_train

    launched = []
    monkeypatch.setattr(
        cli_train, "_run_torchrun", lambda *args, **kwargs: launched.append(args) or 0
    )
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        [
            "train",
            "--config",
            str(DEBUG_CONFIG),
            "--dataloader.dataset",
            "files",
            "--dataloader.dataset_path",
            str(ASSET_DIR / CORPUS_FILE),
            "--validation.enable",
            "--validation.dataset_path",
            "held/*.jsonl",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not launched and list(tmp_path.iterdir()) == []
    assert (
        len(err) == 1 and "[validation] dataset_path: 'held/*.jsonl' matches no file" in err[0]
    ), err


# --------------------------------------------------------------------------------------- real ranks

VALIDATION = ["--validation.enable", "--validation.every", "2", "--validation.steps", "2"]
COMMON = [
    "--training.seq_len",
    str(SEQ),
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--checkpoint.interval",
    "2",
    "--metrics.enable_tensorboard",
    "true",
    *VALIDATION,
]
V_STAGES = [
    "--parallelism.pipeline_parallel_layers_per_stage",
    "1",
    "--parallelism.pipeline_parallel_first_stage_less_layers",
    "0",
    "--parallelism.pipeline_parallel_last_stage_less_layers",
    "0",
]
LAYOUTS = {
    # name: (overrides, data-parallel ranks, document masking)
    "fsdp": ([], 2, False),
    "tp": (["--parallelism.tensor_parallel_degree", "2"], 1, False),
    "pp 1F1B": (["--parallelism.pipeline_parallel_degree", "2"], 1, False),
    # A V schedule: the last stage is rank 0's.
    "pp ZBVZeroBubble": (
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
            *V_STAGES,
        ],
        1,
        False,
    ),
    "cp documents": (
        ["--parallelism.context_parallel_degree", "2", "--dataloader.document_masking", "true"],
        1,
        True,
    ),
}


def _train(rank, world, port, runs, queue):
    """Train each ``(dump folder, overrides, steps)`` in turn in this process, one trainer after
    another."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
    )
    import torch.distributed as dist

    from canon_titan.tools import runtime
    from canon_titan.trainer import CanonTrainer

    CanonTrainer.takes_stop_signals = False  # one process builds several trainers
    runtime.apply()
    try:
        for dump, overrides, steps in runs:
            run = load(
                CONFIGS["llama_canon"],
                [*COMMON, "--training.steps", str(steps), "--job.dump_folder", dump, *overrides],
                environment=False,
            )
            trainer = build_trainer_config(run).build()
            try:
                trainer.train()
            finally:
                trainer.close()
        queue.put((rank, None))
    except Exception as e:  # reported by the test instead of a silent wait
        queue.put((rank, repr(e)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world, runs):
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_train, args=(r, world, port, runs, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert not [r for r in results if r[1]], results


def held_out_loss(step_dir, windows: int, document_masking: bool) -> float:
    """By hand, in this process: the mean next-token loss over the first ``windows`` windows of the
    built-in held-out split (its stories tokenized with BOS and EOS, one stream cut every SEQ
    tokens), with the weights of ``step_dir``; positions restart at every BOS under document
    masking."""
    from tokenizers import Tokenizer

    from test_convert import dcp_tensors

    tokenizer = Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id("<|begin_of_text|>"), tokenizer.token_to_id("<|end_of_text|>")
    stream = []
    for line in (ASSET_DIR / HELD_OUT_FILE).read_text().splitlines():
        stream += [bos, *tokenizer.encode(json.loads(line)["text"]).ids, eos]
    tokens = torch.tensor([stream[w * SEQ : w * SEQ + SEQ + 1] for w in range(windows)])
    model = (
        load(CONFIGS["llama_canon"], ["--training.seq_len", str(SEQ)], environment=False)
        .model_spec()
        .model.build()
    )
    model.init_states()
    model.load_state_dict(dcp_tensors(step_dir))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = None
    if document_masking:
        positions = torch.zeros_like(inputs)
        for b in range(inputs.shape[0]):
            for t in range(1, SEQ):
                positions[b, t] = 0 if inputs[b, t] == bos else positions[b, t - 1] + 1
    with torch.no_grad():
        logits = model.eval()(inputs, positions=positions)
    nll = torch.nn.functional.cross_entropy(
        logits.double().flatten(0, 1), labels.flatten(), reduction="sum"
    )
    return nll.item() / labels.numel()


def validation_points(dump) -> list[tuple[int, float]]:
    """Every ``validation/loss`` event of the run's TensorBoard files, in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = []
    for path in sorted((dump / "tb").rglob("events.out.tfevents.*"), key=os.path.getmtime):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "validation/loss" in accumulator.Tags()["scalars"]:
            events += [(e.step, e.value) for e in accumulator.Scalars("validation/loss")]
    return events


@pytest.mark.slow
def test_validation_loss_is_the_hand_computed_mean_on_every_layout(tmp_path):
    """FSDP, TP (sequence parallel), PP 1F1B and ZBVZeroBubble (whose last stage is rank 0's), CP
    with document masking, on 2 gloo ranks: the validation loss logged at step 2 is the mean token
    loss of the held-out windows it read (2 batches of 2 sequences per data-parallel rank) under the
    checkpoint of step 2, computed in this process."""
    dumps = {name: tmp_path / name.replace(" ", "-") for name in LAYOUTS}
    _spawn(2, [(str(dumps[name]), overrides, 2) for name, (overrides, _, _) in LAYOUTS.items()])
    for name, (_, dp, documents) in LAYOUTS.items():
        points = validation_points(dumps[name])
        assert [step for step, _ in points] == [2], (name, points)
        expected = held_out_loss(dumps[name] / "checkpoint" / "step-2", 2 * 2 * dp, documents)
        assert points[0][1] == pytest.approx(expected, rel=1e-5), name


@pytest.mark.slow
def test_a_resumed_run_continues_the_validation_curve(tmp_path):
    """One rank trains to step 2 (validated and saved), then the same command with steps 4 resumes:
    the curve has steps 2 and 4, each once, each the hand computation under that step's
    checkpoint."""
    dump = str(tmp_path / "run")
    _spawn(1, [(dump, [], 2), (dump, [], 4)])
    points = validation_points(tmp_path / "run")
    assert [step for step, _ in points] == [2, 4]
    for step, value in points:
        assert value == pytest.approx(
            held_out_loss(tmp_path / "run" / "checkpoint" / f"step-{step}", 4, False), rel=1e-5
        ), step
