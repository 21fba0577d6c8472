"""Tokenizers (built at test time, no downloads), document formats, pre-tokenization."""

import base64
import importlib.util
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from canon_titan.components.metrics import LOSS_TAG, read_scalars
from canon_titan.config import ConfigError, load
from canon_titan.data.builtin import ASSET_DIR, generate_corpus
from canon_titan.data.documents import DATALOADER_SKIP, DataError, ReadStats, iter_documents
from canon_titan.data.packed import PackedTextDataLoader, tokenize_stream
from canon_titan.data.pretokenize import open_shards, tokenize_files
from canon_titan.data.tokenizers import LLAMA3_PATTERN, build_tokenizer
from conftest import CONFIGS, REPO, run_training

TEXTS = generate_corpus(400, seed=11)


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory):
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=320,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return folder / "tokenizer.model"


@pytest.fixture(scope="module")
def tiktoken_path(tmp_path_factory):
    from tiktoken._educational import bpe_train

    ranks = bpe_train(
        data="\n".join(TEXTS[:80]), vocab_size=300, pat_str=LLAMA3_PATTERN, visualise=None
    )
    path = tmp_path_factory.mktemp("tt") / "tokenizer.model"
    path.write_text(
        "".join(
            f"{base64.b64encode(t).decode()} {r}\n"
            for t, r in sorted(ranks.items(), key=lambda x: x[1])
        )
    )
    return path


def test_sentencepiece_ids_specials_round_trip(sp_path):
    tok = build_tokenizer(
        "sentencepiece", str(sp_path.parent)
    )  # a folder works as well as the file
    assert (tok.get_vocab_size(), tok.bos_id, tok.eos_id) == (320, 1, 2)  # Llama-2 layout
    text = "Mia lived in Oakford with a cat called Pip."
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1] and 2 not in ids[1:-1]
    assert tok.decode(ids[1:-1]) == text
    assert tok.encode(text) == ids[1:-1]


def test_tiktoken_specials_follow_the_ranks(tiktoken_path):
    tok = build_tokenizer("tiktoken", str(tiktoken_path))
    base = 300  # ranks in the file; Llama-3 has 128,000, so BOS 128000 and EOS 128001
    assert (tok.get_vocab_size(), tok.bos_id, tok.eos_id) == (base + 256, base, base + 1)
    text = 'Leo said, "I found it near the old mill." <|end_of_text|> 42'
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == base and ids[-1] == base + 1
    assert all(i < base for i in ids[1:-1])  # special-token text inside a document is plain text
    assert tok.decode(ids[1:-1]) == text


def test_model_vocab_follows_tokenizer_kind(sp_path, tiktoken_path):
    run = load(
        CONFIGS["llama"], ["--tokenizer.kind", "sentencepiece", "--tokenizer.path", str(sp_path)]
    )
    assert run.model_args.vocab_size == 320
    run = load(
        CONFIGS["llama"], ["--tokenizer.kind", "tiktoken", "--tokenizer.path", str(tiktoken_path)]
    )
    assert run.model_args.vocab_size == 556
    with pytest.raises(
        ConfigError,
        match=r"\[model\] vocab_size: is 2048 but the sentencepiece tokenizer .* has 320 ids",
    ):
        load(
            CONFIGS["llama"],
            [
                "--tokenizer.kind",
                "sentencepiece",
                "--tokenizer.path",
                str(sp_path),
                "--model.vocab_size",
                "2048",
            ],
        )
    with pytest.raises(ConfigError, match=r"\[tokenizer\] path: cannot load a tiktoken tokenizer"):
        load(CONFIGS["llama"], ["--tokenizer.kind", "tiktoken", "--tokenizer.path", str(sp_path)])


def write_formats(folder, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))
    (folder / "a.jsonl").write_text(lines)
    (folder / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    pq.write_table(pa.table({"text": texts}), folder / "c.parquet")
    return [folder / "a.jsonl", folder / "b.jsonl.zst", folder / "c.parquet"]


def test_all_formats_read_the_same_documents(tmp_path):
    for path in write_formats(tmp_path, TEXTS[:50]):
        assert list(iter_documents(str(path))) == TEXTS[:50], path


def test_corrupt_inputs_name_file_and_line_and_can_be_skipped(tmp_path):
    import zstandard

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"text": "a"})
        + "\n{oops\n"
        + json.dumps({"body": "b"})
        + "\n"
        + json.dumps({"text": "c"})
        + "\n"
    )
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a JSON object.*\[dataloader\] on_error"):
        list(iter_documents(str(bad), skip_hint=DATALOADER_SKIP))  # as the dataloader reads them
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a JSON object") as e:
        list(iter_documents(str(bad)))  # a caller with no skip option (the multi-hop generator)
    assert "on_error" not in str(e.value)
    stats = ReadStats()
    assert list(iter_documents(str(bad), on_error="skip", stats=stats)) == ["a", "c"]
    assert (
        stats.skipped == 2
        and "bad.jsonl:3: the 'text' text field is missing; the record's fields: 'body'"
        in stats.problems[1]
    )
    frames = [
        zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[i : i + 50]).encode()
        )
        for i in range(0, 200, 50)
    ]
    truncated = tmp_path / "cut.jsonl.zst"
    truncated.write_bytes(b"".join(frames)[:-100])  # cut inside the last of 4 frames
    with pytest.raises(DataError, match=r"cut.jsonl.zst:\d+: unreadable data after line \d+"):
        list(iter_documents(str(truncated)))
    stats = ReadStats()
    kept = list(iter_documents(str(truncated), on_error="skip", stats=stats))
    assert kept == TEXTS[:150] and stats.skipped == 1


def test_pretokenized_shards_equal_online_tokenization_and_resume(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    paths = write_formats(src, TEXTS[:120])
    out = tmp_path / "tokens"
    index = tokenize_files(
        str(src / "*"), out, kind="hf", tokenizer_path=str(ASSET_DIR), workers=2, log=lambda m: None
    )
    tok = build_tokenizer("hf", str(ASSET_DIR))
    expected = np.concatenate([tokenize_stream(TEXTS[:120], tok, True, True)] * 3)
    store = open_shards(out, tok)
    assert len(store) == len(expected) and np.array_equal(store.slice(0, len(store)), expected)
    # Windows across shard boundaries are stitched.
    cut = int(store.offsets[1])
    assert np.array_equal(store.slice(cut - 5, cut + 5), expected[cut - 5 : cut + 5])
    assert [s["source"] for s in index["shards"]] == [str(p) for p in paths]
    # Resume: only the shard without its completion marker is redone, with the same result.
    (out / "00001.json").unlink()
    messages = []
    tokenize_files(
        str(src / "*"),
        out,
        kind="hf",
        tokenizer_path=str(ASSET_DIR),
        workers=1,
        log=messages.append,
    )
    assert "2 of 3 files already done" in messages[0] and len(messages) == 2
    assert np.array_equal(open_shards(out, tok).slice(0, len(expected)), expected)


def test_token_folder_checks_the_tokenizer(tmp_path, sp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_formats(src, TEXTS[:20])
    tokenize_files(
        str(src / "a.jsonl"),
        tmp_path / "tokens",
        kind="hf",
        tokenizer_path=str(ASSET_DIR),
        log=lambda m: None,
    )
    with pytest.raises(DataError, match="tokenized with a 784-id tokenizer"):
        open_shards(tmp_path / "tokens", build_tokenizer("sentencepiece", str(sp_path)))
    with pytest.raises(DataError, match="holds tokens of another tokenizer"):
        tokenize_files(
            str(src / "a.jsonl"),
            tmp_path / "tokens",
            kind="sentencepiece",
            tokenizer_path=str(sp_path),
            log=lambda m: None,
        )


def test_token_loader_is_layout_independent_and_resumable(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_formats(src, TEXTS)
    tokenize_files(
        str(src / "*"),
        tmp_path / "tokens",
        kind="hf",
        tokenizer_path=str(ASSET_DIR),
        log=lambda m: None,
    )
    tok = build_tokenizer("hf", str(ASSET_DIR))

    def make(rank, world, batch):
        cfg = PackedTextDataLoader.Config(dataset="tokens", dataset_path=str(tmp_path / "tokens"))
        return PackedTextDataLoader(
            cfg,
            dp_world_size=world,
            dp_rank=rank,
            tokenizer=tok,
            seq_len=96,
            local_batch_size=batch,
        )

    single = iter(make(0, 1, 4))
    quads = [iter(make(r, 4, 1)) for r in range(4)]
    for _ in range(6):
        x, y = next(single)
        parts = [next(it) for it in quads]
        assert torch.equal(x["input"], torch.cat([p[0]["input"] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))
    dl = make(1, 2, 2)
    it = iter(dl)
    for _ in range(5):
        next(it)
    state, expected = dl.state_dict(), next(it)
    resumed = make(1, 2, 2)
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert torch.equal(got[0]["input"], expected[0]["input"]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dataset", ["builtin", "files", "tokens"])
def test_packed_loaders_resume_at_another_data_parallel_size(tmp_path, dataset):
    """Four steps on 2 ranks x 2 windows, a checkpoint of every rank's state, then 1 rank x 4 and
    4 ranks x 1: the batches of each rank equal those of a run that had that layout from the
    start."""
    tok = build_tokenizer("hf", str(ASSET_DIR))
    path = None
    if dataset != "builtin":
        src = tmp_path / "src"
        src.mkdir()
        write_formats(src, TEXTS[:120])
        path = str(src / "*")
        if dataset == "tokens":
            tokenize_files(
                path,
                tmp_path / "tokens",
                kind="hf",
                tokenizer_path=str(ASSET_DIR),
                log=lambda m: None,
            )
            path = str(tmp_path / "tokens")

    def make(rank, world, batch):
        cfg = PackedTextDataLoader.Config(dataset=dataset, dataset_path=path)
        return PackedTextDataLoader(
            cfg,
            dp_world_size=world,
            dp_rank=rank,
            tokenizer=tok,
            seq_len=96,
            local_batch_size=batch,
        )

    old = [make(r, 2, 2) for r in range(2)]
    for dl in old:
        it = iter(dl)
        for _ in range(4):
            next(it)
    saved = {}
    for dl in old:
        saved.update(dl.state_dict())
    for world, batch in ((1, 4), (4, 1)):
        for rank in range(world):
            straight = iter(make(rank, world, batch))
            expected = [next(straight) for _ in range(6)][4:]
            resumed = make(rank, world, batch)
            resumed.load_state_dict(saved)
            it = iter(resumed)
            for want in expected:
                got = next(it)
                assert torch.equal(got[0]["input"], want[0]["input"]) and torch.equal(
                    got[1], want[1]
                )


@pytest.mark.slow
def test_training_on_pretokenized_data_with_sentencepiece(tmp_path, sp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_formats(src, generate_corpus(900, seed=21)[:300])
    tokenize_files(
        str(src / "*"),
        tmp_path / "tokens",
        kind="sentencepiece",
        tokenizer_path=str(sp_path),
        log=lambda m: None,
    )
    dump = tmp_path / "run"
    run_training(
        2,
        [
            "--tokenizer.kind",
            "sentencepiece",
            "--tokenizer.path",
            str(sp_path),
            "--dataloader.dataset",
            "tokens",
            "--dataloader.dataset_path",
            str(tmp_path / "tokens"),
            "--training.steps",
            "30",
            "--training.seq_len",
            "128",
            "--metrics.log_freq",
            "1",
            "--checkpoint.enable",
            "false",
            "--job.dump_folder",
            str(dump),
        ],
        config=CONFIGS["llama_canon"],
    )
    losses = read_scalars(dump)
    assert len(losses) == 30 and losses[30] < losses[1] - 1.0


def stream_loader(sources, rank=0, world=1, workers=2, batch=2, seq_len=64, **kw):
    from canon_titan.data.streaming import StreamingTextDataLoader

    cfg = StreamingTextDataLoader.Config(
        sources=[str(s) for s in sources], num_workers=workers, **kw
    )
    return StreamingTextDataLoader(
        cfg,
        dp_world_size=world,
        dp_rank=rank,
        tokenizer=build_tokenizer("hf", str(ASSET_DIR)),
        seq_len=seq_len,
        local_batch_size=batch,
    )


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_streaming_units_read_every_document_exactly_once(tmp_path, ranks):
    from canon_titan.data.streaming import SourceReader

    src = tmp_path / "src"
    src.mkdir()
    files = [str(p) for p in write_formats(src, TEXTS[:101])]  # 3 files x 101 documents

    def one_epoch(unit, units):
        reader, docs = SourceReader(files, unit, units, "text", "fail"), []
        while True:
            text = reader.next()
            if reader.epoch > 0:  # the reader wrapped around: the epoch is complete
                return docs
            docs.append(text)

    expected = one_epoch(0, 1)
    assert len(expected) == 303
    units = ranks * 2  # 2 loader workers per rank
    per_unit = [one_epoch(u, units) for u in range(units)]
    assert all(per_unit)  # every unit has documents
    assert sorted(d for docs in per_unit for d in docs) == sorted(expected)  # each exactly once


def test_a_streamed_source_says_when_its_first_reader_starts_it_again(tmp_path, caplog):
    """Data reader 0 (rank 0's first) logs the end of each pass over its share of a source, once;
    the other readers stay silent. At 432670c sources were re-read without a word."""
    import logging

    from canon_titan.data.streaming import SourceReader

    src = tmp_path / "src"
    src.mkdir()
    files = [str(p) for p in write_formats(src, TEXTS[:101])]  # 3 files x 101 documents
    readers = [SourceReader(files, unit, 2, "text", "fail") for unit in range(2)]
    with caplog.at_level(logging.INFO):
        for reader in readers:
            while reader.epoch < 2:
                reader.next()
    ends = [r.getMessage() for r in caplog.records if "ended" in r.getMessage()]
    assert ends == [
        f"streamed data: epoch {e} of data reader 0 over 3 files ended; it reads its share "
        "of them again"
        for e in (1, 2)
    ], ends


def test_streaming_resume_with_workers_gives_the_same_batches(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_formats(src, TEXTS[:200])
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.jsonl").write_text(
        "".join(json.dumps({"text": t.upper()}) + "\n" for t in TEXTS[200:260])
    )
    sources, weights = [src / "*", other / "*.jsonl"], [3.0, 1.0]
    reference = stream_loader(sources, weights=weights, shuffle_buffer=8)
    it = iter(reference)
    expected = [next(it) for _ in range(9)]
    first = stream_loader(sources, weights=weights, shuffle_buffer=8)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    del it, first
    resumed = stream_loader(sources, weights=weights, shuffle_buffer=8)
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(5), iter(resumed))]
    for (x, y), (gx, gy) in zip(expected[4:], got):
        assert torch.equal(x["input"], gx["input"]) and torch.equal(y, gy)
    # Both sources contribute (upper-case text only comes from the second).
    tok = build_tokenizer("hf", str(ASSET_DIR))
    text = " ".join(tok.decode(x["input"].flatten().tolist()) for x, _ in expected)
    assert "MIA" in text or "LIVED" in text


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["stream", "tokens"])
def test_kill_and_resume_online_and_pretokenized(tmp_path, dataset):
    """Killed at step 10 of 12 (2 processes, checkpoints every 4): the stream run resumes on 2
    processes bitwise, and refuses, before launching, to resume on 1; the token-folder run resumes
    on 1 process (FSDP resharded, 2 windows x 2 accumulation steps) with the losses and grad norms
    of the uninterrupted 2-process run. The stream run logs its mixture (its one source: all the
    tokens) and puts it on TensorBoard at every logged step."""
    import subprocess
    import sys

    from conftest import COMMON, REPO, run_training_until, train_env

    src = tmp_path / "src"
    src.mkdir()
    write_formats(src, generate_corpus(600, seed=31)[:200])
    if dataset == "stream":
        data = [
            "--dataloader.dataset",
            "stream",
            "--dataloader.sources",
            f'["{src}/*"]',
            "--dataloader.num_workers",
            "1",
            "--dataloader.shuffle_buffer",
            "16",
        ]
    else:
        tokenize_files(
            str(src / "*"),
            tmp_path / "tokens",
            kind="hf",
            tokenizer_path=str(ASSET_DIR),
            log=lambda m: None,
        )
        data = [
            "--dataloader.dataset",
            "tokens",
            "--dataloader.dataset_path",
            str(tmp_path / "tokens"),
        ]
    args = (
        COMMON
        + data
        + [
            "--training.steps",
            "12",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "4",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "4",
        ]
    )
    ref, interrupted = tmp_path / "ref", tmp_path / "interrupted"
    out = run_training(2, args + ["--job.dump_folder", str(ref)], config=CONFIGS["llama"])
    if dataset == "stream":
        assert re.search(
            rf"streamed mixture, tokens drawn on dp rank 0 \([\d,]+\): {src}/\*: "
            r"100\.0% \(weight 100%\)",
            out,
        ), out[-3000:]
        shares = read_scalars(ref, "data/source_0_token_share")
        assert shares == {step: 1.0 for step in range(1, 13)}
    run_training_until(
        2,
        args + ["--job.dump_folder", str(interrupted)],
        stop_marker="step: 10",
        config=CONFIGS["llama"],
    )
    resume = args + ["--job.dump_folder", str(interrupted), "--metrics.save_tb_folder", "tb2"]
    if dataset == "stream":
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "canon_titan.cli",
                "train",
                "--nproc",
                "1",
                "--config",
                str(CONFIGS["llama"]),
                *resume,
            ],
            cwd=REPO,
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert refused.returncode == 2 and "canon_titan.launch.torchrun" not in refused.stdout, (
            refused.stderr[-3000:]
        )
        assert (
            "was written by a run streaming its data ([dataloader] dataset = 'stream') on "
            "2 data-parallel "
            "rank(s); this run has 1"
        ) in refused.stderr
    out = run_training(2 if dataset == "stream" else 1, resume, config=CONFIGS["llama"])
    assert "Training starts at step 9" in out
    assert "get_last_lr" not in out  # the schedulers' load, without torch's warning (issue 89)
    for tag in (LOSS_TAG, "grad_norm"):
        reference, resumed = read_scalars(ref, tag), read_scalars(interrupted, tag, tb_folder="tb2")
        assert list(resumed) == [9, 10, 11, 12]
        for step, value in resumed.items():
            if dataset == "stream":  # same layout, state restored exactly: bitwise
                assert value == reference[step], (tag, step)
            else:
                assert value == pytest.approx(
                    reference[step], rel=1e-5 if tag == LOSS_TAG else 1e-4
                ), (tag, step)


def test_document_masking_isolates_packed_documents():
    import model_registry

    spec = model_registry.model_spec("llama", "debug", {"qk_norm": False})
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    bos = 0
    doc1, doc2 = torch.randint(2, 2048, (1, 7)), torch.randint(2, 2048, (1, 9))
    doc1[0, 0] = doc2[0, 0] = bos
    packed = torch.cat([doc1, doc2], dim=1)
    from canon_titan.data.packed import document_positions

    positions = document_positions(packed, bos)
    assert positions[0].tolist() == list(range(7)) + list(range(9))
    with torch.no_grad():
        alone, together = model(doc2), model(packed, positions)
        plain = model(packed)
    torch.testing.assert_close(together[:, 7:], alone, rtol=1e-5, atol=1e-5)  # doc 1 is invisible
    assert not torch.allclose(plain[:, 7:], alone, atol=1e-3)  # without masking it is seen


def test_loaders_emit_document_positions(tmp_path):
    """Positions that restart at every BOS, and with them the documents' boundaries in fla's layout
    (the batch flattened: every BOS and row start, then B * T; each document's 64-token chunks),
    from the packed and the streaming loader (whose batches are collated from windows)."""
    tok = build_tokenizer("hf", str(ASSET_DIR))
    cfg = PackedTextDataLoader.Config(document_masking=True)
    dl = PackedTextDataLoader(
        cfg, dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=256, local_batch_size=2
    )
    src = tmp_path / "src"
    src.mkdir()
    stream = stream_loader(
        write_formats(src, TEXTS[:60])[:1], workers=1, seq_len=256, document_masking=True
    )
    for inputs, _ in (next(iter(dl)), next(iter(stream))):
        positions, tokens = inputs["positions"], inputs["input"]
        assert (positions[tokens == tok.bos_id] == 0).all() and (positions[:, 0] == 0).all()
        assert (positions[:, 1:] - positions[:, :-1])[tokens[:, 1:] != tok.bos_id].eq(1).all()
        starts = [i for i, p in enumerate(positions.flatten().tolist()) if p == 0]
        assert inputs["cu_seqlens"].tolist() == starts + [positions.numel()] and len(starts) > 2
        lengths = [
            b - a for a, b in zip(inputs["cu_seqlens"].tolist(), inputs["cu_seqlens"].tolist()[1:])
        ]
        chunks = [[d, c] for d, n in enumerate(lengths) for c in range(-(-n // 64))]
        assert inputs["chunk_indices"].tolist() == chunks


def test_hub_sources_stream_exactly_once(tmp_path, monkeypatch):
    """The Hub reader, with datasets.load_dataset pointed at a local streaming dataset."""
    import datasets

    from canon_titan.data.streaming import HubSourceReader

    path = tmp_path / "hub.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:30]))
    real_load = datasets.load_dataset
    calls = []

    def fake_load(name, subset=None, split=None, streaming=False):
        calls.append((name, subset, split, streaming))
        return real_load("json", data_files=str(path), split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)

    def one_epoch(unit, units, line=0):
        reader = HubSourceReader("hf:org/corpus:high:train", unit, units, "text", "fail")
        reader.line = line
        docs = []
        while True:
            text = reader.next()
            if reader.epoch > 0:
                return docs
            docs.append(text)

    assert calls == [] and sorted(one_epoch(0, 3) + one_epoch(1, 3) + one_epoch(2, 3)) == sorted(
        TEXTS[:30]
    )
    assert calls[0] == ("org/corpus", "high", "train", True)
    assert one_epoch(1, 3, line=4) == one_epoch(1, 3)[4:]  # resume skips what was read


def test_export_ships_a_sentencepiece_tokenizer_file(tmp_path, sp_path):
    import torch.distributed.checkpoint as dcp

    from canon_titan.convert.hf import to_hf

    run = load(
        CONFIGS["llama"], ["--tokenizer.kind", "sentencepiece", "--tokenizer.path", str(sp_path)]
    )
    model = run.model_spec().model.build()
    model.init_states()
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
    out = to_hf(tmp_path / "ckpt", tmp_path / "hf", run)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert (out / "tokenizer.model").read_bytes() == sp_path.read_bytes()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 320


@pytest.mark.parametrize("kind", ["hf", "sentencepiece", "tiktoken"])
def test_hf_tokenizer_for_lm_eval_matches_ours(kind, sp_path, tiktoken_path):
    """lm-eval sees the run's tokenizer as a transformers tokenizer: same ids, no BOS/EOS added."""
    from canon_titan.evaluation.lm import hf_tokenizer

    path = {"hf": str(ASSET_DIR), "sentencepiece": str(sp_path), "tiktoken": str(tiktoken_path)}[
        kind
    ]
    ours, theirs = build_tokenizer(kind, path), hf_tokenizer(kind, path)
    for text in TEXTS[:20] + ["Mia lived in Oakford.\n\nAnswer me: Ann was born in the year of "]:
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    for text in TEXTS[:20]:  # (decoding an unknown piece differs: "<unk>" vs sentencepiece's " ⁇ ")
        assert theirs.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_the_data_benchmark_runs_and_the_documented_gpu_need_holds():
    """scripts/benchmarks/bench_data.py prints its three paths with a rate each (a small corpus
    here), and the GPU's need that docs/benchmarks/cpu.md quotes is what its FLOP count gives: 40%
    of an H100's 989.5 TFLOP/s over LlamaCanon-1B's FLOPs per token at 4096."""
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "benchmarks" / "bench_data.py"),
            "--documents",
            "300",
            "--seq-len",
            "256",
            "--batch",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for path in (
        "online: read .zst + tokenize",
        "pre-tokenize command (1 worker)",
        "shard batches (2x256)",
    ):
        row = re.search(rf"^{re.escape(path)}\s+([\d,]+)\s+([\d.]+)$", out.stdout, re.M)
        assert row and float(row[1].replace(",", "")) > 0, out.stdout
    spec = importlib.util.spec_from_file_location(
        "bench_data", REPO / "scripts" / "benchmarks" / "bench_data.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    need, flops = bench.required_tokens_per_second("llama_canon", "1B", 4096, 0.4)
    assert need == pytest.approx(0.4 * 989.5e12 / flops)
    documented = (REPO / "docs" / "benchmarks" / "cpu.md").read_text()
    quoted = re.search(
        r"consumes ([\d.]+)k tokens/s \(([\d.]+) GFLOP per token at\s+sequence 4096\)", documented
    )
    assert quoted, "docs/benchmarks/cpu.md no longer quotes the GPU's need"
    assert float(quoted[1]) == round(need / 1e3, 1) and float(quoted[2]) == round(flops / 1e9, 1)
