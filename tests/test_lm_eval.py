"""lm-eval on canon-titan models, offline, with tiny local tasks: an HF export and the same model
as a DCP checkpoint give identical scores, and the scores equal a hand computation from logits."""

import json
import math
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch

pytest.importorskip("lm_eval")

from canon_titan.cli import main  # noqa: E402
from canon_titan.convert.hf import to_hf  # noqa: E402
from canon_titan.evaluation import lm  # noqa: E402
from conftest import MC, PPL, REPO, TINY_TASKS, make_checkpoint, write_tiny_tasks  # noqa: E402

GEN = [{"q": f"Count: {i}, {i + 1},", "a": f" {i + 2}"} for i in range(4)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A debug LlamaCanon as a DCP checkpoint (with its run_config.toml) and as an HF export,
    plus a folder of three tiny local tasks."""
    root = tmp_path_factory.mktemp("lm_eval")
    run, step, _ = make_checkpoint(root / "run", ["--training.seq_len", "128"])
    export = root / "hf"
    to_hf(step, export, run)
    tasks = root / "tasks"
    tasks.mkdir()
    setup = {"root": root, "step": step, "export": export, "tasks": tasks}
    write_tiny_tasks(tasks, gen_docs(setup))
    return setup


def greedy(model, tok, text: str, steps: int = 6) -> str:
    """Greedy continuation by an argmax loop over full forwards (no cache, no BOS), cut at a
    newline."""
    ids = tok.encode(text, add_special_tokens=False)
    start = len(ids)
    for _ in range(steps):
        ids.append(int(_logprobs(model, ids)[-1].argmax()))
    return tok.decode(ids[start:]).split("\n")[0]


def gen_docs(setup) -> list[dict]:
    """Every other target is the model's own greedy continuation, so exact match is 1/2 exactly
    when lm-eval generates greedily without BOS."""
    model, tok = _hf_model(setup)
    return [
        {"q": d["q"], "a": greedy(model, tok, d["q"]) if i % 2 == 0 else d["a"] + " never"}
        for i, d in enumerate(GEN)
    ]


def run_cli(setup, model, out, *extra):
    code = main(
        [
            "eval",
            "lm",
            "--model",
            str(model),
            "--suite",
            *TINY_TASKS,
            "--include-path",
            str(setup["tasks"]),
            "--dtype",
            "fp32",
            "--out",
            str(out),
            *extra,
        ]
    )
    assert code == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(setup):
    root = setup["root"]
    return (
        run_cli(setup, setup["step"].parent, root / "dcp.json"),
        run_cli(setup, setup["export"], root / "export.json"),
    )


def test_export_and_dcp_checkpoint_score_identically(results):
    from_dcp, from_export = results
    for task, metrics in (
        ("tiny_mc", ("acc,none", "acc_norm,none")),
        ("tiny_gen", ("exact_match,none",)),
        ("tiny_ppl", ("word_perplexity,none", "bits_per_byte,none")),
    ):
        for metric in metrics:
            assert from_dcp["results"][task][metric] == from_export["results"][task][metric], (
                task,
                metric,
            )
    assert from_dcp["n-samples"]["tiny_mc"]["effective"] == len(MC)


def _hf_model(setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(setup["export"]), trust_remote_code=True, dtype=torch.float32
    ).eval()
    return model, AutoTokenizer.from_pretrained(str(setup["export"]))


@torch.no_grad()
def _logprobs(model, ids):
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def test_scores_equal_a_hand_computation_without_bos(setup, results):
    """acc / acc_norm: the choice with the highest summed (per-character) log-probability after
    the question, no BOS; bits per byte: the text scored from the EOS prefix lm-eval uses."""
    model, tok = _hf_model(setup)
    acc = acc_norm = 0
    for doc in MC:
        context = tok.encode(doc["q"], add_special_tokens=False)
        scores = []
        for choice in doc["choices"]:
            whole = tok.encode(doc["q"] + choice, add_special_tokens=False)
            cont = whole[len(context) :]
            lp = _logprobs(model, whole)
            scores.append(sum(lp[len(context) - 1 + i, t].item() for i, t in enumerate(cont)))
        acc += max(range(3), key=lambda i: scores[i]) == doc["label"]
        acc_norm += max(range(3), key=lambda i: scores[i] / len(doc["choices"][i])) == doc["label"]
    from_dcp, _ = results
    assert from_dcp["results"]["tiny_mc"]["acc,none"] == pytest.approx(acc / len(MC))
    assert from_dcp["results"]["tiny_mc"]["acc_norm,none"] == pytest.approx(acc_norm / len(MC))

    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    total_ll, total_bytes, total_words = 0.0, 0, 0
    for doc in PPL:
        ids = [prefix] + tok.encode(doc["text"], add_special_tokens=False)
        lp = _logprobs(model, ids)
        total_ll += sum(lp[i, ids[i + 1]].item() for i in range(len(ids) - 1))
        total_bytes += len(doc["text"].encode())
        total_words += len(re.split(r"\s+", doc["text"]))
    ppl = from_dcp["results"]["tiny_ppl"]
    assert ppl["bits_per_byte,none"] == pytest.approx(
        -total_ll / total_bytes / math.log(2), rel=1e-6
    )
    assert ppl["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / total_words), rel=1e-6)


def test_generation_is_greedy_without_bos(results):
    expected = sum(1 for i in range(len(GEN)) if i % 2 == 0) / len(GEN)
    assert results[0]["results"]["tiny_gen"]["exact_match,none"] == pytest.approx(expected)


def test_reference_table_order_and_avg10():
    rng = torch.Generator().manual_seed(0)
    scores = {c.task: torch.rand(1, generator=rng).item() for c in lm.COLUMNS}
    result = {
        "results": {
            c.task: {f"{c.metric},none": scores[c.task], f"{c.metric}_stderr,none": 0.01}
            for c in lm.COLUMNS
        }
    }
    values, printed = lm.table(result)
    header = printed.splitlines()[0].split()
    assert header == [
        "LMB",
        "PIQA",
        "Hella",
        "Wino",
        "ARC-e",
        "ARC-c",
        "SIQA",
        "BoolQ",
        "COPA",
        "OBQA",
        "RACE",
        "CSQA",
        "MMLU",
        "Avg10",
    ]
    ten = [
        "piqa",
        "hellaswag",
        "winogrande",
        "arc_easy",
        "arc_challenge",
        "social_iqa",
        "openbookqa",
        "race",
        "commonsense_qa",
        "mmlu",
    ]
    assert values["Avg10"] == pytest.approx(100 * sum(scores[t] for t in ten) / 10)
    del result["results"]["mmlu"]
    assert lm.table(result)[0]["Avg10"] is None  # only with all ten columns


def test_suites_list_the_reference_tasks():
    import yaml

    def tasks_of(name):
        return yaml.safe_load((REPO / "eval" / "suites" / f"{name}.yaml").read_text())["task"]

    assert tasks_of("canon_all13") == [c.task for c in lm.COLUMNS]
    assert set(tasks_of("canon_avg10")) == {c.task for c in lm.COLUMNS if c.label in lm.AVG10}
    manager = lm.task_manager(["canon_all13"])
    assert not lm.leaf_tasks(
        manager, ["canon_all13"], missing=True
    )  # every name is a known lm-eval task
    recipes = {
        t
        for p in (REPO / "train_configs").glob("*-Nemo-*.toml")
        for t in tomllib.loads(p.read_text())["eval"]["tasks"]
    }
    assert "triviaqa" in recipes and not lm.leaf_tasks(manager, sorted(recipes), missing=True)
    assert len(lm.leaf_tasks(manager, ["canon_avg10"])) > 60  # MMLU's subjects included


def test_offline_run_names_the_missing_datasets(setup):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "canon_titan.cli",
            "eval",
            "lm",
            "--model",
            str(setup["export"]),
            "--suite",
            "arc_easy",
            "boolq",
            "--limit",
            "2",
            "--out",
            str(setup["root"] / "x.json"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "allenai/ai2_arc (task arc_easy)" in proc.stderr and "boolq" in proc.stderr
    assert not (setup["root"] / "x.json").exists()


def test_bad_model_and_task_names_fail_clearly(setup, capsys):
    assert main(["eval", "lm", "--model", str(setup["root"] / "nope"), "--suite", "tiny_mc"]) == 2
    assert "nope: no such folder" in capsys.readouterr().err
    assert (
        main(
            [
                "eval",
                "lm",
                "--model",
                str(setup["export"]),
                "--suite",
                "no_such_task",
                "--include-path",
                str(setup["tasks"]),
            ]
        )
        == 2
    )
    assert "unknown lm-eval task or group 'no_such_task'" in capsys.readouterr().err


def test_results_are_named_after_the_model_and_printed_with_lm_evals_table(setup, capsys):
    """Two models under one parent keep two result files (one used to overwrite the other), and the
    printed table is lm-eval's own, with its standard-error column."""
    other = setup["root"] / "hf_copy"
    if not other.exists():
        subprocess.run(["cp", "-r", str(setup["export"]), str(other)], check=True)
    for model in (setup["export"], other):
        assert (
            main(
                [
                    "eval",
                    "lm",
                    "--model",
                    str(model),
                    "--suite",
                    "tiny_mc",
                    "--include-path",
                    str(setup["tasks"]),
                    "--dtype",
                    "fp32",
                ]
            )
            == 0
        )
    printed = capsys.readouterr().out
    first, second = (
        json.loads((setup["root"] / f"eval_lm_{name}.json").read_text())
        for name in ("hf", "hf_copy")
    )
    assert first["model"] == str(setup["export"]) and second["model"] == str(other)
    assert "Tasks" in printed and "Stderr" in printed and "|tiny_mc" in printed
    stderr = first["results"]["tiny_mc"]["acc_stderr,none"]
    acc = first["results"]["tiny_mc"]["acc,none"]
    n = len(MC)
    assert stderr == pytest.approx(
        math.sqrt(acc * (1 - acc) / (n - 1))
    )  # lm-eval's sample standard error


LONG_TASKS = {
    "long_gen": "output_type: generate_until\ndoc_to_text: q\ndoc_to_target: a\n"
    "target_delimiter: ''\n"
    "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\n  do_sample: false\n"
    "metric_list:\n  - metric: exact_match\n",
    "long_mc": TINY_TASKS["tiny_mc"],
    "long_ppl": TINY_TASKS["tiny_ppl"],
}


def _text_of(tok, tokens: int, seed: int) -> str:
    """Words until the text has at least ``tokens`` tokens."""
    import random

    rng = random.Random(seed)
    words = []
    while len(tok.encode(" ".join(words), add_special_tokens=False)) < tokens:
        words.append(
            rng.choice(
                ["river", "stone", "the", "old", "mill", "ran", "past", "green", "light", "north"]
            )
        )
    return " ".join(words)


def _greedy_ids(model, tok, ids: list[int], steps: int) -> str:
    ids, start = list(ids), len(ids)
    for _ in range(steps):
        ids.append(int(_logprobs(model, ids)[-1].argmax()))
    return tok.decode(ids[start:]).split("\n")[0]


@pytest.fixture(scope="module")
def long_inputs(setup):
    """Tasks whose inputs pass the model's training length (128): a generation prompt of ~190 tokens
    (read whole at twice that length) and one of ~300 (still cut), a multiple-choice question of
    ~300 tokens, and a text of ~190 tokens to score as perplexity. Each generation target is the
    model's greedy continuation of what it should read: the whole prompt, or its last 256 - 4
    tokens."""
    model, tok = _hf_model(setup)
    folder = setup["root"] / "long_tasks"
    folder.mkdir(exist_ok=True)
    short, long = _text_of(tok, 190, 0), _text_of(tok, 300, 1)
    long_ids = tok.encode(long, add_special_tokens=False)
    gen = [
        {"q": short, "a": greedy(model, tok, short, steps=4)},
        {"q": long, "a": _greedy_ids(model, tok, long_ids[-(256 - 4) :], steps=4)},
    ]
    mc = [{"q": _text_of(tok, 300, 2), "choices": [" blue", " a green cat", " red"], "label": 1}]
    ppl = [{"text": _text_of(tok, 190, 3)}]
    for name, rows in (("long_gen", gen), ("long_mc", mc), ("long_ppl", ppl)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n" + LONG_TASKS[name]
        )
    return {
        "folder": folder,
        "model": model,
        "tok": tok,
        "gen": gen,
        "mc": mc,
        "ppl": ppl,
        "long_ids": long_ids,
    }


def _eval_long(setup, long_inputs, out, *extra):
    code = main(
        [
            "eval",
            "lm",
            "--model",
            str(setup["export"]),
            "--suite",
            "long_gen",
            "long_mc",
            "long_ppl",
            "--include-path",
            str(long_inputs["folder"]),
            "--dtype",
            "fp32",
            "--out",
            str(out),
            *extra,
        ]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_inputs_past_the_training_length_are_read_to_twice_it_and_the_rest_is_reported(
    setup, long_inputs, capsys
):
    """A model trained at 128 tokens is evaluated at max_length 256, as the release evaluates its
    4096-token models at 8192: a 190-token prompt is read whole (its greedy continuation is the one
    from the whole prompt; the 190-token text is one perplexity window, RoPE past 128), and what is
    still longer is cut from the left, said once per task and written to the results: the counts,
    the longest input (tokenized here) and the limit (256, less the 4 tokens to generate)."""
    record = _eval_long(setup, long_inputs, setup["root"] / "long.json")
    printed = capsys.readouterr().out
    model, tok = long_inputs["model"], long_inputs["tok"]
    assert record["training_length"] == 128 and record["max_length"] == 256
    assert record["results"]["long_gen"]["exact_match,none"] == 1.0

    mc = long_inputs["mc"][0]
    longest_mc = max(
        len(tok.encode(mc["q"] + c, add_special_tokens=False)) - 1 for c in mc["choices"]
    )
    assert record["truncated"] == {
        "long_gen": {
            "inputs": 1,
            "of": 2,
            "longest_tokens": len(long_inputs["long_ids"]),
            "limit_tokens": 252,
        },
        "long_mc": {"inputs": 3, "of": 3, "longest_tokens": longest_mc, "limit_tokens": 256},
    }
    for task in ("long_gen", "long_mc"):
        assert (
            sum(
                f"{task}: " in line and "inputs are longer" in line for line in printed.splitlines()
            )
            == 1
        )
    assert "long_ppl: " not in printed

    text = long_inputs["ppl"][0]["text"]
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    ids = [prefix] + tok.encode(text, add_special_tokens=False)
    assert 128 < len(ids) <= 256
    lp = _logprobs(model, ids)
    total_ll = sum(lp[i, ids[i + 1]].item() for i in range(len(ids) - 1))
    words = len(re.split(r"\s+", text))
    assert record["results"]["long_ppl"]["word_perplexity,none"] == pytest.approx(
        math.exp(-total_ll / words), rel=1e-6
    )


def test_max_length_reads_longer_inputs(setup, long_inputs, capsys):
    record = _eval_long(setup, long_inputs, setup["root"] / "long_512.json", "--max-length", "512")
    assert record["max_length"] == 512 and record["truncated"] == {}
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "eval",
                "lm",
                "--model",
                str(setup["export"]),
                "--suite",
                "long_gen",
                "--max-length",
                "1",
            ]
        )
    assert (
        exit_.value.code == 2
        and "--max-length must be >= 2 tokens, got 1" in capsys.readouterr().err
    )


def test_lm_evals_noise_is_quiet_and_its_real_warnings_are_not(setup, tmp_path, capsys):
    """An eval/ task reads its file through a custom dataset: lm-eval's warning that custom kwargs
    can be passed (twice per task, 16 per multi-hop group) is gone. In a process set up as `eval lm`
    sets it up, a Hub retry line shows once, not once through huggingface_hub's own handler and
    again through the root logger's, and any other warning of those loggers still shows."""
    (tmp_path / "multihop").mkdir()
    rows = [
        {
            "prompt": f"Ann Bee Cole was born in the year of {1950 + i}. "
            "Answer me: Ann Bee Cole was born in the year of ",
            "answer": str(1950 + i),
        }
        for i in range(2)
    ]
    (tmp_path / "multihop" / "1hop_0k.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    assert (
        main(
            [
                "eval",
                "lm",
                "--model",
                str(setup["export"]),
                "--suite",
                "multihop_1hop_0k",
                "--data-dir",
                str(tmp_path),
                "--dtype",
                "fp32",
                "--out",
                str(tmp_path / "out.json"),
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "Custom kwargs" not in out + err

    script = (
        "import logging\n"
        "import datasets, huggingface_hub, lm_eval  # what eval lm imports, with their "
        "own handlers\n"
        "from canon_titan.tools.startup import init_logging\n"
        "from canon_titan.evaluation import lm\n"
        "init_logging()\n"
        "lm.quiet_lm_eval()\n"
        "logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')\n"
        "logging.getLogger('lm_eval.api.task').warning('multihop_1hop_0k: a real problem')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout + proc.stderr).count("Retrying in 1s [Retry 1/5].") == 1
    assert "multihop_1hop_0k: a real problem" in proc.stdout + proc.stderr


def test_the_guide_names_the_results_file_as_the_command_does(capsys):
    """docs/evaluation.md says what --out defaults to as `eval lm --help` does, and the command
    writes that name."""
    with pytest.raises(SystemExit):
        main(["eval", "lm", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    documented = re.search(
        r"`--out`, default `([^`]+)`", (REPO / "docs" / "evaluation.md").read_text()
    ).group(1)
    assert f"default: {documented} beside the model folder" in shown
    assert lm.default_output("/x/runs/hf").name == documented.replace("<model folder>", "hf")
