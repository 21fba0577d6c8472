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
    """Greedy continuation by an argmax loop over full forwards (no cache, no BOS), cut at a newline."""
    ids = tok.encode(text, add_special_tokens=False)
    start = len(ids)
    for _ in range(steps):
        ids.append(int(_logprobs(model, ids)[-1].argmax()))
    return tok.decode(ids[start:]).split("\n")[0]


def gen_docs(setup) -> list[dict]:
    """Every other target is the model's own greedy continuation, so exact match is 1/2 exactly
    when lm-eval generates greedily without BOS."""
    model, tok = _hf_model(setup)
    return [{"q": d["q"], "a": greedy(model, tok, d["q"]) if i % 2 == 0 else d["a"] + " never"}
            for i, d in enumerate(GEN)]


def run_cli(setup, model, out, *extra):
    code = main(["eval", "lm", "--model", str(model), "--suite", *TINY_TASKS, "--include-path", str(setup["tasks"]),
                 "--dtype", "fp32", "--out", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(setup):
    root = setup["root"]
    return (run_cli(setup, setup["step"].parent, root / "dcp.json"),
            run_cli(setup, setup["export"], root / "export.json"))


def test_export_and_dcp_checkpoint_score_identically(results):
    from_dcp, from_export = results
    for task, metrics in (("tiny_mc", ("acc,none", "acc_norm,none")), ("tiny_gen", ("exact_match,none",)),
                          ("tiny_ppl", ("word_perplexity,none", "bits_per_byte,none"))):
        for metric in metrics:
            assert from_dcp["results"][task][metric] == from_export["results"][task][metric], (task, metric)
    assert from_dcp["n-samples"]["tiny_mc"]["effective"] == len(MC)


def _hf_model(setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(setup["export"]), trust_remote_code=True,
                                                 dtype=torch.float32).eval()
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
            cont = whole[len(context):]
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
    assert ppl["bits_per_byte,none"] == pytest.approx(-total_ll / total_bytes / math.log(2), rel=1e-6)
    assert ppl["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / total_words), rel=1e-6)


def test_generation_is_greedy_without_bos(results):
    expected = sum(1 for i in range(len(GEN)) if i % 2 == 0) / len(GEN)
    assert results[0]["results"]["tiny_gen"]["exact_match,none"] == pytest.approx(expected)


def test_reference_table_order_and_avg10():
    rng = torch.Generator().manual_seed(0)
    scores = {c.task: torch.rand(1, generator=rng).item() for c in lm.COLUMNS}
    result = {"results": {c.task: {f"{c.metric},none": scores[c.task], f"{c.metric}_stderr,none": 0.01}
                          for c in lm.COLUMNS}}
    values, printed = lm.table(result)
    header = printed.splitlines()[0].split()
    assert header == ["LMB", "PIQA", "Hella", "Wino", "ARC-e", "ARC-c", "SIQA", "BoolQ", "COPA", "OBQA", "RACE",
                      "CSQA", "MMLU", "Avg10"]
    ten = ["piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "social_iqa", "openbookqa", "race",
           "commonsense_qa", "mmlu"]
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
    assert not lm.leaf_tasks(manager, ["canon_all13"], missing=True)  # every name is a known lm-eval task
    recipes = {t for p in (REPO / "train_configs").glob("*-Nemo-*.toml")
               for t in tomllib.loads(p.read_text())["eval"]["tasks"]}
    assert "triviaqa" in recipes and not lm.leaf_tasks(manager, sorted(recipes), missing=True)
    assert len(lm.leaf_tasks(manager, ["canon_avg10"])) > 60  # MMLU's subjects included


def test_offline_run_names_the_missing_datasets(setup):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "canon_titan.cli", "eval", "lm", "--model", str(setup["export"]),
                           "--suite", "arc_easy", "boolq", "--limit", "2", "--out", str(setup["root"] / "x.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "allenai/ai2_arc (task arc_easy)" in proc.stderr and "boolq" in proc.stderr
    assert not (setup["root"] / "x.json").exists()


def test_bad_model_and_task_names_fail_clearly(setup, capsys):
    assert main(["eval", "lm", "--model", str(setup["root"] / "nope"), "--suite", "tiny_mc"]) == 2
    assert "nope: no such folder" in capsys.readouterr().err
    assert main(["eval", "lm", "--model", str(setup["export"]), "--suite", "no_such_task",
                 "--include-path", str(setup["tasks"])]) == 2
    assert "unknown lm-eval task or group 'no_such_task'" in capsys.readouterr().err


def test_results_are_named_after_the_model_and_printed_with_lm_evals_table(setup, capsys):
    """Two models under one parent keep two result files (one used to overwrite the other), and the
    printed table is lm-eval's own, with its standard-error column."""
    other = setup["root"] / "hf_copy"
    if not other.exists():
        subprocess.run(["cp", "-r", str(setup["export"]), str(other)], check=True)
    for model in (setup["export"], other):
        assert main(["eval", "lm", "--model", str(model), "--suite", "tiny_mc", "--include-path", str(setup["tasks"]),
                     "--dtype", "fp32"]) == 0
    printed = capsys.readouterr().out
    first, second = (json.loads((setup["root"] / f"eval_lm_{name}.json").read_text()) for name in ("hf", "hf_copy"))
    assert first["model"] == str(setup["export"]) and second["model"] == str(other)
    assert "Tasks" in printed and "Stderr" in printed and "|tiny_mc" in printed
    stderr = first["results"]["tiny_mc"]["acc_stderr,none"]
    acc = first["results"]["tiny_mc"]["acc,none"]
    n = len(MC)
    assert stderr == pytest.approx(math.sqrt(acc * (1 - acc) / (n - 1)))  # lm-eval's sample standard error
