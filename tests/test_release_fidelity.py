"""Exports and imports against what the PhysicsLM4 release and both transformers majors read:
RoPE theta in transformers 4.x, the release's full-RoPE configs, every field that changes the
maths compared on import, Canon-bias exports flagged; the release's Depo default; and the
``data synthetic`` dump against the dataloader."""

import json
import os
import subprocess
import sys

import pytest
import torch

from canon_titan.convert.dcp_io import ConversionError
from canon_titan.convert.hf import from_hf, to_hf
from conftest import CONFIGS, REPO, make_checkpoint
from test_convert import TOKENS, dcp_tensors

TRANSFORMERS_4 = REPO / ".venv" / "transformers4"
"""transformers 4.47.1 (the release's) with its tokenizers and hub client, installed apart by
scripts/test.sh."""


def _export(tmp_path, config, overrides):
    run, step, model = make_checkpoint(tmp_path, overrides, config=config)
    return run, to_hf(step, tmp_path / "hf", run), model


def test_plain_llama_export_carries_rope_theta_for_both_transformers_majors(tmp_path):
    from transformers import LlamaForCausalLM

    run, out, model = _export(
        tmp_path, CONFIGS["llama"], ["--model.qk_norm", "false", "--model.rope_theta", "500000"]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 500000 and config["rope_parameters"]["rope_theta"] == 500000
    assert config["dtype"] == config["torch_dtype"] == "float32"
    with torch.no_grad():
        reference = model(TOKENS)
        logits = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(TOKENS).logits
    torch.testing.assert_close(
        logits, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item()
    )
    if not TRANSFORMERS_4.is_dir():
        pytest.skip("transformers 4.x not installed apart (scripts/test.sh installs it)")
    torch.save({"tokens": TOKENS, "logits": reference}, tmp_path / "expected.pt")
    check = (
        f"import torch, transformers\n"
        f"from transformers import LlamaForCausalLM\n"
        f"assert transformers.__version__.startswith('4.'), transformers.__version__\n"
        f"model = LlamaForCausalLM.from_pretrained({str(out)!r}, "
        "torch_dtype=torch.float32).eval()\n"
        f"print('theta', model.config.rope_theta, 'dtype', model.config.torch_dtype)\n"
        f"expected = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        f"with torch.no_grad():\n"
        f"    logits = model(expected['tokens']).logits\n"
        "print('error', ((logits - expected['logits']).abs().max() / "
        "expected['logits'].abs().max()).item())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(TRANSFORMERS_4)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert (
        words[words.index("theta") + 1] == "500000.0"
        and words[words.index("dtype") + 1] == "torch.float32"
    )
    assert float(words[words.index("error") + 1]) < 1e-5


def test_from_hf_reads_the_release_full_rope_null(tmp_path):
    """The release writes ``"rope_dim": null`` for full RoPE (and no partial_rotary_factor)."""
    overrides = ["--model.rope_dim", "32"]  # the debug head is 32 wide: full RoPE
    run, out, _ = _export(tmp_path, CONFIGS["llama_canon"], overrides)
    config = json.loads((out / "config.json").read_text())
    config["rope_dim"] = None
    del config["partial_rotary_factor"]
    (out / "config.json").write_text(json.dumps(config))
    from canon_titan.config import load

    full = load(CONFIGS["llama_canon"], ["--model.rope_dim", "32"], environment=False)
    back = from_hf(out, tmp_path / "back", full)
    original = dcp_tensors(tmp_path / "ckpt" / "step-0")
    assert all(torch.equal(t, original[k]) for k, t in dcp_tensors(back).items())
    partial = load(CONFIGS["llama_canon"], [], environment=False)  # rope_dim 8: another model
    with pytest.raises(ConversionError, match="rope_dim is 32, the run config expects 8"):
        from_hf(out, tmp_path / "partial", partial)


@pytest.mark.parametrize(
    "config, field, value, found, expected",
    [
        ("llama_canon", "canon_residual", False, "False", "True"),
        ("llama_canon", "canon_activation", True, "True", "False"),
        ("llama_canon", "canon_kernel", 3, "3", "4"),
        ("llama_canon", "rope_theta", 500000.0, "500000.0", "10000.0"),
        ("llama_canon", "rms_norm_eps", 1e-6, "1e-06", "1e-05"),
        ("llama_canon", "hidden_act", "gelu", "'gelu'", "'silu'"),
        (
            "llama",
            "rope_parameters",
            {"rope_type": "default", "rope_theta": 123.0},
            "123.0",
            "10000.0",
        ),
        ("llama", "rms_norm_eps", 1e-6, "1e-06", "1e-05"),
        ("llama", "attention_bias", True, "True", "False"),
        ("gla5", "norm_eps", 1e-6, "1e-06", "1e-05"),
        ("gla5", "canon_residual", False, "False", "True"),
        ("mamba2", "use_conv_bias", False, "False", "True"),
    ],
)
def test_from_hf_names_every_mismatched_field(tmp_path, config, field, value, found, expected):
    """A config.json that describes another model than the run's is refused, naming the field
    and both values (before, these imported silently and gave different logits)."""
    overrides = ["--model.qk_norm", "false"] if config == "llama" else []
    run, step, _ = make_checkpoint(
        tmp_path, overrides, config=REPO / "train_configs" / f"{config}_debug.toml"
    )
    out = to_hf(step, tmp_path / "hf", run)
    hf = json.loads((out / "config.json").read_text())
    hf[field] = value
    if field == "rope_parameters":
        hf.pop("rope_theta")  # a transformers-5 config: theta only inside rope_parameters
    (out / "config.json").write_text(json.dumps(hf))
    name = "rope_theta" if field == "rope_parameters" else field
    with pytest.raises(
        ConversionError, match=rf"{name} is {found}, the run config expects {expected}"
    ):
        from_hf(out, tmp_path / "back", run)
    assert not (tmp_path / "back").exists()


def test_canon_bias_exports_say_the_release_cannot_load_them(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        run, out, _ = _export(tmp_path, CONFIGS["llama_canon"], ["--model.canon_bias", "true"])
    note = json.loads((out / "config.json").read_text())["canon_titan_note"]
    assert "release's LlamaCanon code cannot load this model" in note
    assert any("cannot load this model" in r.getMessage() for r in caplog.records)
    plain = _export(tmp_path / "plain", CONFIGS["llama_canon"], [])[1]
    assert "canon_titan_note" not in json.loads((plain / "config.json").read_text())


def test_depo_defaults_follow_the_release():
    """The release's depo_data has separator=False: no 9700 token before the edges."""
    import random

    from synthetic_data import depo

    assert (
        depo.DepoParams().separator is False
        and not depo.DEPO1.separator
        and not depo.DEPO2.separator
    )
    sample = depo.generate(depo.DEPO1, random.Random(0))
    assert depo.SEPARATOR not in sample.tokens
    assert (
        depo.SEPARATOR
        in depo.generate(depo.DepoParams(N=10, separator=True), random.Random(0)).tokens
    )


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "canon_titan.cli", "data", "synthetic", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_data_synthetic_writes_the_dataloaders_samples(tmp_path):
    """The dump is the loader's training stream (same ids, tokens and masks, in order) with the
    task section's parameters, and by default the loss mask of the reference, on answers only;
    --test writes the held-out items eval synthetic scores."""
    from canon_titan.config import load
    from canon_titan.data.synthetic import SyntheticDataLoader, loader_config

    out = tmp_path / "depo.jsonl"
    proc = _cli("depo1", "--n", "30", "--out", str(out), "--depo.N", "12")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    run = load(
        REPO / "train_configs" / "llama_debug.toml",
        [
            "--training.seq_len",
            "2048",
            "--dataloader.dataset",
            "depo1",
            "--depo.N",
            "12",
            "--dataloader.answer_only_loss",
            "true",
        ],
    )
    loader = SyntheticDataLoader(
        loader_config(run), dp_world_size=1, dp_rank=0, seq_len=2048, local_batch_size=1
    )
    expected = [s for _, s in zip(range(30), loader.samples())]
    assert len(records) == 30
    for record, (window, sample, tokens, flags) in zip(records, expected):
        assert (
            record["window"],
            tuple(record["sample"]),
            record["tokens"],
            record["loss_mask"],
        ) == (window, sample, tokens, flags)
        assert record["answer_mask"] == flags  # answer-only loss trains exactly on the answers

    test = tmp_path / "test.jsonl"
    assert _cli("mano", "--test", "--n", "3", "--out", str(test)).returncode == 0
    items = [json.loads(line) for line in test.read_text().splitlines()]
    from canon_titan.evaluation.synthetic import DEFAULT_TEST_SEED
    from synthetic_data.tasks import make_task

    want = make_task("mano").test_items(DEFAULT_TEST_SEED, 3)
    assert [(i["group"], i["prompt"], i["answer"]) for i in items] == [
        (w.group, w.prompt, w.answer) for w in want
    ]

    bad = _cli("depo1", "--n", "3", "--out", str(tmp_path / "x.jsonl"), "--depo.M", "3")
    assert bad.returncode == 2 and "[depo] M: unknown key" in bad.stderr
    assert not (tmp_path / "x.jsonl").exists()
