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
    return PackedTextDataLoader(config, dp_world_size=world, dp_rank=rank, tokenizer=tokenizer,
                                seq_len=seq_len, local_batch_size=batch)


def test_committed_corpus_is_what_the_generator_makes():
    assert (ASSET_DIR / CORPUS_FILE).read_text() == corpus_jsonl(generate_corpus())


def test_tokenizer_round_trip_and_specials(tokenizer):
    text = "Mia lived in Oakford with a cat called Pip. She found 7 red kites!"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id and tokenizer.bos_id != tokenizer.eos_id
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
    key = lambda xs: sorted(tuple(x[0, :8].tolist()) for x in xs)
    assert key(epoch0) == key(epoch1)  # each epoch covers every window once ...
    assert [x[0, :8].tolist() for x in epoch0] != [x[0, :8].tolist() for x in epoch1]  # ... in a new order


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
