"""The synthetic tasks as a dataloader, in TOML, and scored through greedy generation."""

import json
import random
import subprocess
import sys

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX

from canon_titan.config import ConfigError, load
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.data.synthetic import SyntheticDataLoader
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.evaluation.synthetic import format_table, greedy_continuation
from conftest import REPO
from synthetic_data import brevo, depo, mano
from synthetic_data.common import BOS
from synthetic_data.tasks import PAD, make_task, summarize

PLAYGROUND = REPO / "train_configs" / "playground"
DEPO = {"N": 10, "K": 4, "mini_vocab": 8}


def loader(
    dataset="depo1",
    task=None,
    rank=0,
    world=1,
    batch=4,
    seq_len=128,
    answer_only=True,
    seed=5,
    tokenizer=None,
):
    config = SyntheticDataLoader.Config(
        dataset=dataset,
        task=dict(DEPO if task is None else task),
        seed=seed,
        answer_only_loss=answer_only,
    )
    return SyntheticDataLoader(
        config,
        dp_world_size=world,
        dp_rank=rank,
        seq_len=seq_len,
        local_batch_size=batch,
        tokenizer=tokenizer,
    )


def segments(row_input, row_positions):
    """The samples of a window's input: runs of positions that count up from 0. The last run is
    left out: the input lacks the window's last token (it is only a target)."""
    starts = [i for i, p in enumerate(row_positions.tolist()) if p == 0]
    return [row_input[a:b].tolist() for a, b in zip(starts, starts[1:])]


def test_windows_hold_whole_valid_samples_and_answer_only_targets():
    dl = loader()
    params = dl.task.params
    inputs, targets = dl.batch(0)
    checked = 0
    for row in range(4):
        x, pos, y = inputs["input"][row], inputs["positions"][row], targets[row]
        assert torch.equal(
            y[:-1][y[:-1] != IGNORE_INDEX], x[1:][y[:-1] != IGNORE_INDEX]
        )  # targets = next token
        for sample in segments(x, pos):
            if sample[0] == PAD:
                assert set(sample) == {PAD}
                continue
            assert sample[0] == BOS
            # Every query of the sample is answered by the k-th successor of the written cycle.
            nxt = depo.successor_map(sample, params)
            marks = [i for i, t in enumerate(sample) if t == depo.ANSWER]
            for at in marks:
                hop_at = max(i for i in range(at) if depo.HOP_BASE <= sample[i] < depo.ANSWER)
                node = tuple(sample[hop_at + 1 : at])
                for _ in range(sample[hop_at] - depo.HOP_BASE):
                    node = nxt[node]
                end = at + 1 + len(node)
                assert tuple(sample[at + 1 : end]) == node
                checked += 1
        # The loss sees exactly the answer markers and the answer words.
        counted = [int(x[i + 1]) for i in range(len(x) - 1) if y[i] != IGNORE_INDEX]
        assert counted.count(depo.ANSWER) == int((x[1:] == depo.ANSWER).sum())
        assert all(t == depo.ANSWER or t <= 2 * params.mini_vocab for t in counted)
    assert checked > 20


def test_all_tokens_loss_and_pad_and_sample_starts_are_ignored():
    dl = loader(answer_only=False)
    inputs, targets = dl.batch(0)
    x, pos, y = inputs["input"], inputs["positions"], targets
    nxt_is_start = torch.cat(
        [pos[:, 1:] == 0, torch.ones_like(pos[:, :1], dtype=torch.bool)], dim=1
    )
    nxt_is_pad = torch.cat([x[:, 1:] == PAD, torch.zeros_like(x[:, :1], dtype=torch.bool)], dim=1)
    interior = ~nxt_is_start & ~nxt_is_pad
    assert torch.equal(y[:, :-1] != IGNORE_INDEX, interior[:, :-1])


def test_same_seed_same_batches_ranks_disjoint_and_layout_independent():
    a, b = loader(seed=9), loader(seed=9)
    assert all(torch.equal(u, v) for u, v in zip(a.batch(8)[0].values(), b.batch(8)[0].values()))
    assert not torch.equal(loader(seed=10).batch(8)[0]["input"], a.batch(8)[0]["input"])
    whole = loader(batch=4).batch(0)
    halves = [loader(batch=2, rank=r, world=2).batch(0) for r in (0, 1)]
    assert torch.equal(torch.cat([h[0]["input"] for h in halves]), whole[0]["input"])
    assert torch.equal(torch.cat([h[1] for h in halves]), whole[1])
    # Ranks read disjoint windows: no sample of rank 0 appears on rank 1 over several steps.
    seen = [set(), set()]
    for r in (0, 1):
        it = iter(loader(batch=2, rank=r, world=2))
        for _ in range(5):
            x = next(it)[0]
            for row in range(2):
                seen[r].update(
                    tuple(s) for s in segments(x["input"][row], x["positions"][row]) if s[0] == BOS
                )
    assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_resume_gives_the_next_batch_of_an_uninterrupted_run():
    straight = iter(loader(world=2, rank=1, batch=2))
    expected = [next(straight) for _ in range(5)][3:]
    first = loader(world=2, rank=1, batch=2)
    it = iter(first)
    next(it), next(it), next(it)
    state = first.state_dict()
    resumed = loader(world=2, rank=1, batch=2)
    resumed.load_state_dict(state)
    it = iter(resumed)
    for want in expected:
        got = next(it)
        assert torch.equal(got[0]["input"], want[0]["input"]) and torch.equal(got[1], want[1])


def checkpoint_of(loaders) -> dict:
    """What DCP keeps of the loaders of every rank: one copy of the shared entries, each rank's
    own."""
    merged = {}
    for dl in loaders:
        merged.update(dl.state_dict())
    return merged


@pytest.mark.parametrize("world,batch", [(1, 4), (4, 1), (2, 2)])
def test_resume_at_another_data_parallel_size_sees_the_batches_of_that_size(world, batch):
    """Three steps on 2 ranks x 2 windows, then a resume on ``world`` ranks x ``batch`` windows (the
    same global batch): each rank gets exactly what it would have got had the run had that layout
    from the start, carried samples included (every window carries one on)."""
    old = [loader(rank=r, world=2, batch=2) for r in range(2)]
    iters = [iter(dl) for dl in old]
    for _ in range(3):
        for it in iters:
            next(it)
    saved = checkpoint_of(old)
    assert {k for k in saved if k.startswith("carries_dp_rank_")} == {
        "carries_dp_rank_0",
        "carries_dp_rank_1",
    }
    for rank in range(world):
        straight = iter(loader(rank=rank, world=world, batch=batch))
        expected = [next(straight) for _ in range(6)][3:]
        resumed = loader(rank=rank, world=world, batch=batch)
        resumed.expect_checkpoint(sorted(saved))
        assert sorted(resumed.state_dict()) == sorted(saved)  # the template DCP fills
        resumed.load_state_dict(saved)
        assert resumed.state_dict()[f"carries_dp_rank_{rank}"]  # its own share of the carries
        packed = []
        pack = resumed.pack
        resumed.pack = lambda index, carried: packed.append(index) or pack(index, carried)
        it = iter(resumed)
        for want in expected:
            got = next(it)
            assert torch.equal(got[0]["input"], want[0]["input"]) and torch.equal(got[1], want[1])
        assert len(packed) == 3 * batch  # its own windows only: no replay of the windows before


@pytest.mark.parametrize(
    "dataset,task,seq",
    [("brevo2", {"N": 10}, 256), ("mano", {"L": 6}, 64), ("lano", {"sizes": [1, 3, 3, 3, 3]}, 128)],
)
def test_other_integer_tasks_pack_valid_samples(dataset, task, seq):
    dl = loader(dataset, task, seq_len=seq)
    inputs, targets = dl.batch(3)
    found = 0
    for row in range(4):
        for sample in segments(inputs["input"][row], inputs["positions"][row]):
            if sample[0] != BOS and not (dataset == "mano" and sample[0] == BOS - 1):
                continue
            found += 1
            if dataset == "brevo2":
                assert brevo.is_correct(sample, dl.task.params)
            elif dataset == "mano":
                assert mano.evaluate_prefix(sample[2:-2]) == sample[-1] - mano.LEAF_BASE
            else:
                assert sample[-1] == dl.task.eos and dl.task.grammar.accepts(sample[1:-1])
    assert found >= 4


def test_capo_windows_are_tokenized_biographies():
    tokenizer = build_tokenizer("hf", str(ASSET_DIR))
    dl = loader(
        "capo_bios", {"individuals": 20}, answer_only=False, seq_len=256, tokenizer=tokenizer
    )
    inputs, targets = dl.batch(0)
    names = {p.name for p in dl.task.people}
    bios = 0
    for row in range(4):
        for sample in segments(inputs["input"][row], inputs["positions"][row]):
            if sample[0] == tokenizer.bos_id:
                text = tokenizer.decode(sample[1:-1])
                assert any(text.startswith(n) for n in names) and text.count(".") == 6, text
                bios += 1
    assert bios >= 4
    with pytest.raises(ValueError, match="answer_only_loss"):
        loader("capo_bios", {"individuals": 20}, answer_only=True, tokenizer=tokenizer)
    with pytest.raises(
        ValueError, match=r"more than a window of seq_len \+ 1 = 65: raise \[training\] seq_len"
    ):
        loader("capo_bios", {"individuals": 20}, answer_only=False, seq_len=64, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="100 samples in a row were too long"):
        loader("lano", {"sizes": [1, 3, 3, 3, 3]}, seq_len=8)


# ----------------------------------------------------------------------------- TOML


def test_playground_configs_resolve_with_task_vocab_and_sections(tmp_path):
    run = load(PLAYGROUND / "depo.toml", [], environment=True)
    assert (
        run["model"]["vocab_size"] == 10000
        and run["depo"]["N"] == 8
        and run["depo"]["separator"] is True
    )
    assert "brevo" not in run.sections and "capo" not in run.sections
    config = tmp_path / "depo2.toml"
    config.write_text(
        '[model]\nname = "llama"\nflavor = "debug"\n[training]\nseq_len = 512\n'
        '[dataloader]\ndataset = "depo2"\n[depo]\nN = 6\n'
    )
    run = load(config, [])
    assert (run["depo"]["N"], run["depo"]["K"], run["depo"]["mini_vocab"]) == (
        6,
        16,
        3,
    )  # depo2's preset
    assert run["depo"]["separator"] is False  # the release's default; the playground sets its own


@pytest.mark.parametrize(
    "dataset,answer_only",
    [
        ("depo1", True),
        ("brevo2", True),
        ("mano", True),
        ("lano", True),
        ("capo_bios", False),
        ("builtin", False),
    ],
)
def test_answer_only_loss_follows_the_reference_unless_set(dataset, answer_only):
    """Unset, the integer-token tasks train on their answer tokens only, as the reference does ("we
    pretrain only on those answer tokens"); text keeps the loss on every token."""
    config = REPO / "train_configs" / "llama_debug.toml"
    base = ["--training.seq_len", "2048", "--dataloader.dataset", dataset]
    assert load(config, base, environment=False)["dataloader"]["answer_only_loss"] is answer_only
    if answer_only:
        full = load(config, [*base, "--dataloader.answer_only_loss", "false"], environment=False)
        assert full["dataloader"]["answer_only_loss"] is False


@pytest.mark.parametrize(
    "config,overrides,key,message",
    [
        ("depo", ["--depo.hops", "3"], "[depo] hops", "unknown key"),
        ("depo", ["--brevo.N", "9"], "[brevo] N", "reads [depo]"),
        (
            "depo",
            ["--depo.N", "60", "--depo.max_word_len", "2", "--depo.separator", "false"],
            "[training] seq_len",
            "seq_len >= 300",
        ),
        ("depo", ["--model.vocab_size", "5000"], "[model] vocab_size", ">= 10000"),
        (
            "text",
            ["--dataloader.dataset", "capo_bios", "--dataloader.answer_only_loss", "true"],
            "[dataloader] answer_only_loss",
            "whole biographies",
        ),
        (
            "text",
            ["--dataloader.answer_only_loss", "true"],
            "[dataloader] answer_only_loss",
            "not dataset = 'builtin'",
        ),
        ("text", ["--mano.L", "3"], "[mano] L", "is not a synthetic task"),
        (
            "text",
            ["--dataloader.dataset", "lano", "--lano.grammar", "/nope.json"],
            "[lano] grammar",
            "nope.json",
        ),
        (
            "text",
            ["--dataloader.dataset", "mano", "--mano.operators", "+%"],
            "[mano] operators",
            "subset of",
        ),
        (
            "depo",
            ["--depo.mini_vocab", "2", "--depo.max_word_len", "1"],
            "[depo] N",
            "only 2 distinct words",
        ),
        ("depo", ["--depo.K", "600"], "[depo] K", "1 <= K < 500"),
        (
            "depo",
            ["--depo.min_word_len", "3", "--depo.max_word_len", "2"],
            "[depo] max_word_len",
            "below min_word_len",
        ),
        (
            "text",
            [
                "--dataloader.dataset",
                "lano",
                "--lano.sizes",
                "[1, 1]",
                "--lano.rule_lengths",
                "[2, 2]",
            ],
            "[lano] rules_per_symbol",
            "only 1 distinct rules",
        ),
        (
            "text",
            ["--dataloader.dataset", "lano", "--lano.grammar", "BAD_GRAMMAR"],
            "[lano] grammar",
            "reference JSON layout",
        ),
    ],
)
def test_task_config_errors_name_the_key(config, overrides, key, message, tmp_path):
    path = (
        PLAYGROUND / "depo.toml"
        if config == "depo"
        else REPO / "train_configs" / "llama_debug.toml"
    )
    bad = tmp_path / "bad.json"
    bad.write_text('{"depth": 1}')
    overrides = [str(bad) if o == "BAD_GRAMMAR" else o for o in overrides]
    with pytest.raises(ConfigError) as e:
        load(path, overrides)
    assert e.value.key == key and message in e.value.message, str(e.value)


# ------------------------------------------------------------------------------ scoring


class Oracle(torch.nn.Module):
    """A 'model' whose next-token logits solve Depo or Mano from the tokens alone."""

    def __init__(self, solve):
        super().__init__()
        self.solve = solve

    def forward(self, tokens):
        ids = tokens[0].tolist()
        logits = torch.zeros(1, len(ids), 10000)
        logits[0, -1, self.solve(ids)] = 1.0
        return logits


def depo_oracle(params):
    def solve(ids):
        hop_at = max(i for i, t in enumerate(ids) if depo.HOP_BASE <= t < depo.ANSWER)
        at = ids.index(depo.ANSWER, hop_at)
        node = tuple(ids[hop_at + 1 : at])
        for _ in range(ids[hop_at] - depo.HOP_BASE):
            node = depo.successor_map(ids, params)[node]
        return node[len(ids) - at - 1]

    return solve


def test_greedy_generation_with_an_oracle_scores_100_and_a_constant_model_near_0():
    task = make_task("depo1", N=12, K=4, mini_vocab=8)
    items = task.test_items(3, 10)
    right = [greedy_continuation(Oracle(depo_oracle(task.params)), item) for item in items]
    assert summarize(task, items, right)["overall"]["accuracy"] == 1.0
    constant = [greedy_continuation(Oracle(lambda ids: 9), item) for item in items]
    assert all(c == [9] for c in constant)  # 9 ends a word (ids 9..16 with mini_vocab 8): one token
    assert summarize(task, items, constant)["overall"]["accuracy"] < 0.3
    mano_task = make_task("mano", L=4)
    mano_items = mano_task.test_items(3, 10)
    solved = [
        greedy_continuation(Oracle(lambda ids: 5000 + mano.evaluate_prefix(ids[2:-1])), i)
        for i in mano_items
    ]
    result = summarize(mano_task, mano_items, solved)
    assert result["overall"]["accuracy"] == 1.0 and list(result["groups"]) == [
        "L=1",
        "L=2",
        "L=3",
        "L=4",
    ]
    table = format_table(
        {**result, "dataset": "mano", "model": "oracle", "test_set": mano_task.test_set(10)}
    )
    assert "L=4" in table and "100.0%" in table
    assert "(10 expressions per number of operators L)" in table


def test_eval_cli_reports_a_missing_checkpoint(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "canon_titan.cli",
            "eval",
            "synthetic",
            "--config",
            str(PLAYGROUND / "depo.toml"),
            "--checkpoint",
            str(tmp_path / "none"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "eval error" in proc.stderr and "does not exist" in proc.stderr


def test_capo_people_export_and_bior_training_texts(tmp_path):
    config = tmp_path / "capo.toml"
    config.write_text(
        '[model]\nname = "llama"\nflavor = "debug"\n[dataloader]\ndataset = "capo_bios"\n'
        "[capo]\nindividuals = 12\npopulation_seed = 4\n"
    )
    people_file = tmp_path / "people.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "canon_titan.cli",
            "data",
            "capo-people",
            "--config",
            str(config),
            "--out",
            str(people_file),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    people = [json.loads(line) for line in people_file.read_text().splitlines()]
    task = make_task("capo_bios", individuals=12, population_seed=4)
    assert [p["name"] for p in people] == [p.name for p in task.people]
    assert all(p["university"] in p["prompt"] and p["birthday"] in p["prompt"] for p in people)
    # bioR: free texts about these people, sentence order permuted per sample, name first.
    bior = tmp_path / "bior.jsonl"
    bior.write_text(
        "".join(
            json.dumps(
                {
                    "id": p["id"],
                    "text": f"{p['name']} grew up in {p['birth_city']}. "
                    f"{p['pronoun']} studied {p['field']}. {p['pronoun']} likes tea.",
                }
            )
            + "\n"
            for p in people
        )
    )
    task = make_task("capo_bios", individuals=12, population_seed=4, bior_path=str(bior))
    texts = [task.train_sample(random.Random(i)) for i in range(30)]
    assert len(set(texts)) > 12 and all(
        any(t.startswith(p["name"] + " ") for p in people) for t in texts
    )
    run = load(config, ["--capo.bior_path", str(bior)])
    assert run["capo"]["bior_path"] == str(bior)


def test_trainer_config_carries_the_task():
    from canon_titan.config.build import build_trainer_config

    run = load(PLAYGROUND / "depo.toml", ["--depo.N", "9"])
    config = build_trainer_config(run)
    assert isinstance(config.dataloader, SyntheticDataLoader.Config)
    assert config.dataloader.task["N"] == 9 and config.dataloader.answer_only_loss is True
    assert config.model_spec.model.tok_embeddings.num_embeddings == 10000


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_capo_recall_through_real_tokenizers(kind, tmp_path):
    """An oracle emitting the tokens of prompt + answer scores 100% through greedy generation,
    for a byte-level BPE and for SentencePiece (which drops a leading space decoding a fragment)."""
    task = make_task("capo_bios", individuals=40)
    if kind == "hf":
        tokenizer = build_tokenizer("hf", str(ASSET_DIR))
    else:
        import sentencepiece as spm

        bios = [task.train_sample(random.Random(i)) for i in range(400)]
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(bios),
            model_prefix=str(tmp_path / "tokenizer"),
            vocab_size=400,
            model_type="bpe",
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            character_coverage=1.0,
            minloglevel=2,
        )
        tokenizer = build_tokenizer("sentencepiece", str(tmp_path / "tokenizer.model"))
    items = task.test_items(2, 5)
    continuations = []
    for item in items:
        full = tokenizer.encode(item.prompt + item.answer, add_bos=True, add_eos=False)
        model = Oracle(
            lambda ids, full=full: full[len(ids)] if len(ids) < len(full) else tokenizer.eos_id
        )
        continuations.append(greedy_continuation(model, item, tokenizer))
    assert summarize(task, items, continuations)["overall"]["accuracy"] == 1.0, continuations[:3]
    other = [
        greedy_continuation(
            Oracle(lambda ids: tokenizer.encode(" Boston.", add_bos=False, add_eos=False)[0]),
            item,
            tokenizer,
        )
        for item in items[:6]
    ]
    assert summarize(task, items[:6], other)["overall"]["correct"] == 0


# ----------------------------------------------------------------------------- packing is unbiased

# Every preset at a 2048-token window (room for the longest sample of each), Capo with the
# built-in tokenizer. The carry stride is the global batch: 4 windows here.
PRESETS = ["depo1", "depo2", "brevo1", "brevo2", "mano", "lano", "capo_bios"]


def _full_windows(dl, steps):
    """Each window's tokens, the last one (a target only) put back."""
    it = iter(dl)
    for _ in range(steps):
        inputs, targets = next(it)
        for x, y in zip(inputs["input"], targets):
            last = y[-1].item()
            yield x.tolist() + [last if last != IGNORE_INDEX else PAD]


def _reference_packing(dl, windows):
    """A slow re-statement of the rule: window w holds the sample carried from w - 4, then the
    draws of its own stream while they fit; the first that does not fit starts window w + 4."""
    from canon_titan.data.synthetic import sample_stream

    def tokens(sample):
        generated = dl.task.train_sample(sample_stream(5, *sample))
        return (
            generated.tokens
            if hasattr(generated, "tokens")
            else dl.tokenizer.encode(generated, add_bos=True, add_eos=True)
        )

    carries, expected = {}, []
    for w in range(windows):
        content = [carries.pop(w)] if w in carries else []
        used = sum(len(tokens(s)) for s in content)
        k = 0
        while True:
            n = len(tokens((w, k)))
            if n > 2049:  # too long for any window: redrawn (Lano, Capo)
                k += 1
                continue
            if used + n > 2049:
                carries[w + 4] = (w, k)
                break
            content.append((w, k))
            used += n
            k += 1
        expected.append(content)
    return expected, tokens


@pytest.mark.parametrize("dataset", PRESETS)
def test_windows_hold_every_drawn_sample_once_in_order(dataset):
    """Exact: the windows are the generator's draws, each once; nothing is dropped for not
    fitting."""
    tokenizer = build_tokenizer("hf", str(ASSET_DIR)) if dataset == "capo_bios" else None
    dl = loader(dataset, {}, seq_len=2048, answer_only=False, tokenizer=tokenizer)
    got = list(_full_windows(dl, 6))
    expected, tokens = _reference_packing(dl, len(got))
    for window, content in zip(got, expected):
        flat = [t for sample in content for t in tokens(sample)]
        assert window[: len(flat)] == flat and set(window[len(flat) :]) <= {PAD}


@pytest.mark.parametrize("dataset", PRESETS)
def test_packed_sample_sizes_follow_the_generator(dataset):
    """Sizes of the samples in the windows against as many fresh draws of the generator: a
    two-sample KS test at a fixed seed. Dropping the samples that do not fit (the old packer) fails
    it with these 3000 samples: p = 4e-8 (depo1), 1e-7 (depo2), 1e-5 (brevo2); for Lano and Mano,
    whose samples are short against the window, the drop was too rare to show (p 0.56, 0.94)."""
    from scipy.stats import ks_2samp

    tokenizer = build_tokenizer("hf", str(ASSET_DIR)) if dataset == "capo_bios" else None
    dl = loader(dataset, {}, seq_len=2048, answer_only=False, tokenizer=tokenizer)
    packed = []
    for _window, _sample, tokens, _ in dl.samples():
        packed.append(len(tokens))
        if len(packed) == 3000:
            break
    rng = random.Random("independent draws")
    fresh = []
    while len(fresh) < len(packed):
        n = len(dl.draw((-1, len(fresh) + rng.randrange(10**9)))[0])
        if n <= 2049:
            fresh.append(n)
    assert ks_2samp(packed, fresh).pvalue > 0.01
