"""Built-in corpus, tokenizer and the packed dataloader (layout independence, resume)."""

import json

import numpy as np
import pytest
import torch

from canon_titan.data.builtin import ASSET_DIR, CORPUS_FILE, corpus_jsonl, generate_corpus
from canon_titan.data.documents import iter_documents
from canon_titan.data.inputs import DataConfigError
from canon_titan.data.packed import PackedTextDataLoader, tokenize_stream


@pytest.fixture(scope="module")
def tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=str(ASSET_DIR))


def loader(tokenizer, rank=0, world=1, batch=4, seq_len=32, **kw):
    config = PackedTextDataLoader.Config(**kw)
    return PackedTextDataLoader(
        config,
        dp_world_size=world,
        dp_rank=rank,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=batch,
    )


def test_committed_corpus_is_what_the_generator_makes():
    assert (ASSET_DIR / CORPUS_FILE).read_text() == corpus_jsonl(generate_corpus())


def test_tokenizer_round_trip_and_specials(tokenizer):
    text = "Mia lived in Oakford with a cat called Pip. She found 7 red kites!"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert (
        ids[0] == tokenizer.bos_id
        and ids[-1] == tokenizer.eos_id
        and tokenizer.bos_id != tokenizer.eos_id
    )
    assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.get_vocab_size() <= 2048


def test_windows_are_slices_of_the_bos_eos_stream(tokenizer):
    dl = loader(tokenizer, shuffle=False)
    texts = list(iter_documents(str(ASSET_DIR / CORPUS_FILE)))[:3]
    expected = np.concatenate([tokenizer.encode(t, add_bos=True, add_eos=True) for t in texts])
    inputs, labels = next(iter(dl))
    stream = torch.cat([inputs["input"][0], labels[0][-1:]])
    assert torch.equal(stream, torch.from_numpy(expected[:33].astype(np.int64)))
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])  # labels are inputs shifted by one


def test_global_batch_does_not_depend_on_dp_layout(tokenizer):
    single = iter(loader(tokenizer, batch=4))
    pair = [iter(loader(tokenizer, rank=r, world=2, batch=2)) for r in range(2)]
    for _ in range(5):
        x1, y1 = next(single)
        parts = [next(it) for it in pair]
        assert torch.equal(x1["input"], torch.cat([p[0]["input"] for p in parts]))
        assert torch.equal(y1, torch.cat([p[1] for p in parts]))


def test_ranks_see_disjoint_windows_and_epochs_reshuffle(tokenizer):
    dl = loader(tokenizer, batch=1, seq_len=512)
    n = dl.num_windows
    it = iter(dl)
    epoch0 = [next(it)[0]["input"] for _ in range(n)]
    epoch1 = [next(it)[0]["input"] for _ in range(n)]

    def key(xs):
        return sorted(tuple(x[0, :8].tolist()) for x in xs)

    assert key(epoch0) == key(epoch1)  # each epoch covers every window once ...
    assert [x[0, :8].tolist() for x in epoch0] != [
        x[0, :8].tolist() for x in epoch1
    ]  # ... in a new order


def test_resume_from_state_gives_the_same_next_batches(tokenizer):
    dl = loader(tokenizer, rank=1, world=2, batch=3)
    it = iter(dl)
    for _ in range(7):
        next(it)
    state = dl.state_dict()
    expected = [next(it) for _ in range(3)]
    resumed = loader(tokenizer, rank=1, world=2, batch=3)
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    for (x, y), (x2, y2) in zip(expected, (next(it2) for _ in range(3))):
        assert torch.equal(x["input"], x2["input"]) and torch.equal(y, y2)


def test_finite_loader_stops(tokenizer):
    dl = loader(tokenizer, batch=8, seq_len=1024, infinite=False)
    batches = list(dl)
    assert len(batches) == dl.num_windows // 8


def test_small_dataset_is_rejected(tmp_path, tokenizer):
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "tiny"}) + "\n")
    with pytest.raises(DataConfigError, match="fewer than one global batch"):
        loader(tokenizer, dataset="files", dataset_path=str(small))


def test_stream_dtype_fits_vocabulary(tokenizer):
    assert tokenize_stream(["a b"], tokenizer, True, True).dtype == np.uint16


def test_the_end_of_each_epoch_is_said_once_with_the_tokens_seen(tokenizer, caplog):
    """A corpus smaller than the run is read again: each pass's end is logged once (rank 0), with
    the windows of a pass and the tokens seen in all; a loader resumed mid-epoch says only the ends
    it reaches. At 432670c the data was re-looped without a word."""
    import logging

    dl = loader(tokenizer, batch=3, seq_len=256)
    n = dl.num_windows
    batches = (3 * n) // 3 + 2  # past the end of the third pass
    it = iter(dl)
    with caplog.at_level(logging.INFO):
        for _ in range(batches):
            next(it)
    ends = [r.getMessage() for r in caplog.records if "ended (" in r.getMessage()]
    passes = (batches * 3 - 1) // n  # passes completed before the last sample read
    assert passes == 3 and len(ends) == passes, ends
    for epoch, message in enumerate(ends, 1):
        assert message.startswith(
            f"dataset 'builtin': epoch {epoch} ended ({n:,} windows of 256 tokens each, "
            f"{epoch * n * 256:,} tokens seen in all); epoch {epoch + 1} reads the same data "
            "again, reshuffled"
        ), message
    caplog.clear()
    resumed = loader(tokenizer, batch=3, seq_len=256)
    resumed.load_state_dict({"next_sample": n + 3})  # inside the second pass
    it = iter(resumed)
    with caplog.at_level(logging.INFO):
        for _ in range(n // 3 + 1):
            next(it)
    assert [r.getMessage()[:34] for r in caplog.records if "ended (" in r.getMessage()] == [
        "dataset 'builtin': epoch 2 ended ("
    ]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_text_field_under_another_name_is_named_with_the_key_to_set(tmp_path, tokenizer, suffix):
    """Documents whose text is under "content": the error names the record's fields and the setting
    that reads them ([dataloader] text_key), not on_error = "skip" (which skips every record and
    trains on nothing). With on_error = "skip" anyway, every record skipped is an error, not 0
    tokens. At
    432670c: "missing the 'text' text field (use [dataloader] on_error = "skip" to skip bad
    records)"."""
    rows = [{"id": i, "content": f"document {i}: " + "word " * 50, "lang": "en"} for i in range(40)]
    path = tmp_path / f"docs.{suffix}"
    if suffix == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        where = (
            f"{path}:1: the 'text' text field is missing; the record's fields: 'id', "
            "'content', 'lang'"
        )
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        where = f"{path}: no column 'text' (columns: id, content, lang)"
    with pytest.raises(DataConfigError) as error:
        loader(tokenizer, dataset="files", dataset_path=str(path))
    message = str(error.value)
    assert message.startswith(where) and "on_error" not in message, message
    assert message.endswith('set [dataloader] text_key = "content" if its text is there'), message
    with pytest.raises(
        DataConfigError,
        match=r"every record was skipped \(\d+, \[dataloader\] on_error = \"skip\"\)",
    ):
        loader(tokenizer, dataset="files", dataset_path=str(path), on_error="skip")
    dl = loader(tokenizer, dataset="files", dataset_path=str(path), text_key="content")
    assert dl.num_windows > 0


def test_a_record_without_the_field_after_good_ones_may_be_skipped(tmp_path):
    """Where earlier records had the field, a record without it is a bad record: skipping stays the
    advice."""
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "odd one"}) + "\n")
    with pytest.raises(
        Exception,
        match=r"docs.jsonl:2: the 'text' text field is missing; the record's fields: "
        r"'body'; set K=body if its text is there \(use SKIP to skip bad records\)",
    ):
        list(iter_documents(str(path), "text", "fail", skip_hint="SKIP", key_hint="K={}"))
