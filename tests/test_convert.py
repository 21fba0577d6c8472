"""DCP <-> Hugging Face conversion, checked against canon-titan's own forward and transformers."""

import json
import subprocess
import sys

import pytest
import torch

from canon_titan.components.metrics import read_scalars
from canon_titan.config import load
from canon_titan.convert.dcp_io import (
    ConversionError,
    find_step_dir,
    load_model,
    load_tensor,
    model_tensor_metadata,
)
from canon_titan.convert.hf import from_hf, to_hf
from canon_titan.data.builtin import ASSET_DIR
from conftest import COMMON, CONFIGS, make_checkpoint, run_training, seed_checkpoint, start_from
from model_registry import register_with_transformers

CANON_CONFIG = CONFIGS["llama_canon"]


def dcp_tensors(step_dir):
    step_dir = find_step_dir(step_dir)
    return {k: load_tensor(step_dir, k, m) for k, m in model_tensor_metadata(step_dir).items()}


def hf_logits(out_dir, tokens):
    from transformers import AutoModelForCausalLM

    register_with_transformers()
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits, model


TOKENS = torch.randint(0, 700, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("canon_set", ["", "AC", "ABCD"])
@pytest.mark.parametrize("layout", ["lingua", "huggingface"])
def test_exported_logits_match_canon_titan(tmp_path, canon_set, layout):
    run, step, model = make_checkpoint(tmp_path, ["--model.canon_set", canon_set])
    out = to_hf(step, tmp_path / "hf", run, rope_layout=layout)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "LlamaCanon" and config["canon_set"] == canon_set
    assert config["rope_version"] == layout and config["rope_dim"] == 8
    logits, hf_model = hf_logits(out, TOKENS)
    with torch.no_grad():
        reference = model(TOKENS)
    assert type(hf_model).__name__ == "LlamaCanonForCausalLM"
    torch.testing.assert_close(
        logits, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item()
    )
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert ("model.layers.0.self_attn.canonB.weight" in names) == ("B" in canon_set)
    assert ("model.layers.0.canonA.weight" in names) == ("A" in canon_set)
    assert "model.layers.0.self_attn.q_norm.weight" in names


def test_plain_llama_exports_as_standard_llama(tmp_path):
    from transformers import LlamaForCausalLM

    run, step, model = make_checkpoint(
        tmp_path, ["--model.qk_norm", "false"], config=CONFIGS["llama"]
    )
    out = to_hf(step, tmp_path / "hf", run, dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert not (out / "modeling_llama_canon.py").exists()
    hf_model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits, reference = hf_model(TOKENS).logits, model(TOKENS)
    torch.testing.assert_close(
        logits, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item()
    )


def test_the_export_tokenizer_says_the_model_s_length(tmp_path):
    """A model trained at 256 tokens: the exported tokenizer's model_max_length is 256, as is the
    config's max_position_embeddings, whatever the tokenizer folder said (the built-in one: 4096,
    which 432670c copied as is), and AutoTokenizer reads it so."""
    from transformers import AutoTokenizer

    run, step, _ = make_checkpoint(tmp_path, ["--training.seq_len", "256"])
    assert json.loads((ASSET_DIR / "tokenizer_config.json").read_text())["model_max_length"] != 256
    out = to_hf(step, tmp_path / "hf", run, dtype="fp32")
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 256
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 256
    assert AutoTokenizer.from_pretrained(out).model_max_length == 256


@pytest.mark.parametrize(
    "config,overrides,architecture",
    [
        (CONFIGS["llama"], ["--model.qk_norm", "false"], "LlamaForCausalLM"),
        (CANON_CONFIG, [], "LlamaCanonForCausalLM"),
    ],
)
def test_in_memory_conversion_equals_the_export(tmp_path, config, overrides, architecture):
    """What `eval lm` and in-training evaluation build from DCP tensors without writing files
    is the model `to-hf` exports, with canon-titan's logits."""
    from canon_titan.convert.hf import dcp_to_hf_model

    run, step, model = make_checkpoint(tmp_path, overrides, config=config)
    in_memory = dcp_to_hf_model(step, run, dtype="fp32")
    exported, _ = hf_logits(to_hf(step, tmp_path / "hf", run), TOKENS)
    with torch.no_grad():
        logits, reference = in_memory(TOKENS).logits, model(TOKENS)
    assert type(in_memory).__name__ == architecture and not in_memory.training
    torch.testing.assert_close(logits, exported, rtol=0, atol=0)
    torch.testing.assert_close(
        logits, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item()
    )


def test_remote_code_loads_without_canon_titan(tmp_path):
    run, step, model = make_checkpoint(tmp_path, ["--model.canon_set", "ABCD"])
    out = to_hf(step, tmp_path / "hf", run)
    with torch.no_grad():
        torch.save(model(TOKENS), tmp_path / "ref.pt")
    torch.save(TOKENS, tmp_path / "tokens.pt")
    script = f"""
import sys, torch
sys.modules["canon_titan"] = None  # make any import of canon-titan fail
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True,
                                         dtype=torch.float32).eval()
assert m.__class__.__module__.startswith("transformers_modules"), m.__class__.__module__
with torch.no_grad():
    logits = m(torch.load({str(tmp_path / "tokens.pt")!r})).logits
ref = torch.load({str(tmp_path / "ref.pt")!r})
torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
print("remote-ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert "remote-ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("layout", ["lingua", "huggingface"])
def test_greedy_generate_with_cache_equals_argmax_loop(tmp_path, layout):
    run, step, _ = make_checkpoint(tmp_path, ["--model.canon_set", "ABCD"], seed=3)
    out = to_hf(step, tmp_path / "hf", run, rope_layout=layout)
    _, model = hf_logits(out, TOKENS)
    prompt = TOKENS[:1, :7]
    model.generation_config.eos_token_id = None  # compare 32 raw greedy steps, no early stop
    generated = model.generate(prompt, max_new_tokens=32, do_sample=False, use_cache=True)
    sequence = prompt
    with torch.no_grad():
        for _ in range(32):
            next_token = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
    assert torch.equal(generated, sequence)
    assert len(set(sequence[0, 7:].tolist())) > 5  # a non-degenerate continuation


@pytest.mark.parametrize(
    "config, overrides, layout",
    [
        (CONFIGS["llama"], [], "lingua"),
        (CONFIGS["llama"], ["--model.qk_norm", "false"], "lingua"),  # standard LlamaForCausalLM
        (CANON_CONFIG, [], "huggingface"),
        (CANON_CONFIG, ["--model.canon_bias", "true"], "lingua"),
    ],
)
def test_round_trip_is_bit_identical(tmp_path, config, overrides, layout):
    run, step, _ = make_checkpoint(tmp_path, overrides, config=config)
    hf_dir = to_hf(step, tmp_path / "hf", run, rope_layout=layout, max_shard_size=200_000)
    assert len(list(hf_dir.glob("model-*.safetensors"))) > 1  # several shards
    back = from_hf(hf_dir, tmp_path / "back", run)
    original, restored = dcp_tensors(step), dcp_tensors(back)
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallelism",
    [
        ["--parallelism.data_parallel_shard_degree", "2"],
        ["--parallelism.tensor_parallel_degree", "2"],
    ],
)
def test_round_trip_from_distributed_checkpoints(tmp_path, tmp_path_factory, parallelism):
    seed = seed_checkpoint("llama_canon", tmp_path_factory)
    dump = start_from(seed, tmp_path / "run")
    run_training(
        2,
        COMMON
        + parallelism
        + ["--training.steps", "2", "--checkpoint.interval", "2", "--job.dump_folder", str(dump)],
        config=CANON_CONFIG,
    )
    run = load(dump / "run_config.toml", environment=False)
    step = dump / "checkpoint" / "step-2"
    hf_dir = to_hf(dump / "checkpoint", tmp_path / "hf", run)  # the newest step is picked
    back = from_hf(hf_dir, tmp_path / "back", run)
    original, restored = dcp_tensors(step), dcp_tensors(back)
    assert original.keys() == restored.keys() and len(original) > 50
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    # The trained weights moved away from the seed, so this is not a copy of step-0.
    assert not torch.equal(
        original["layers.0.attention.wq.weight"], dcp_tensors(seed)["layers.0.attention.wq.weight"]
    )
    logits, _ = hf_logits(hf_dir, TOKENS)
    with torch.no_grad():
        reference = load_model(run, step)(TOKENS)
    torch.testing.assert_close(
        logits, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item()
    )


@pytest.mark.slow
def test_training_starts_from_imported_hf_weights(tmp_path, tmp_path_factory):
    seed = seed_checkpoint("llama_canon", tmp_path_factory)
    run = load(CANON_CONFIG, ["--training.seq_len", "128"], environment=False)
    hf_dir = to_hf(seed, tmp_path / "hf", run, dtype="fp32", rope_layout="huggingface")
    imported = from_hf(hf_dir, tmp_path / "imported", run)
    args = COMMON + ["--training.steps", "2", "--checkpoint.enable"]
    direct = start_from(seed, tmp_path / "direct")
    run_training(1, args + ["--job.dump_folder", str(direct)], config=CANON_CONFIG)
    out = run_training(
        1,
        args
        + [
            "--job.dump_folder",
            str(tmp_path / "from_hf"),
            "--checkpoint.initial_load_path",
            str(imported),
        ],
        config=CANON_CONFIG,
    )
    assert f"Loading the checkpoint from {imported}" in out
    assert read_scalars(tmp_path / "from_hf") == read_scalars(direct)


def test_bad_inputs_fail_clearly_and_leave_nothing(tmp_path):
    run, step, _ = make_checkpoint(tmp_path, [])
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="does not exist"):
        to_hf(tmp_path / "missing", out, run)
    wrong = load(CANON_CONFIG, ["--model.canon_set", "AC"], environment=False)
    with pytest.raises(
        ConversionError, match=r"tensor 'layers.0.attention.canonB.weight' is not part of the model"
    ):
        to_hf(step, out, wrong)
    wider = load(CANON_CONFIG, ["--model.dim", "256"], environment=False)
    with pytest.raises(ConversionError, match=r"tensor '.*' has shape .* expects"):
        to_hf(step, out, wider)
    hf_dir = to_hf(step, tmp_path / "hf", run)
    shard = next(hf_dir.glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ConversionError, match=r"model-00001-of-00001.safetensors"):
        from_hf(hf_dir, out, run)
    with pytest.raises(ConversionError, match="num_hidden_layers is 4, the run config expects 6"):
        from_hf(hf_dir, out, load(CANON_CONFIG, ["--model.n_layers", "6"], environment=False))
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_from_hf_takes_the_vocabulary_of_the_folder(tmp_path, capsys):
    """A model whose vocabulary is not the config tokenizer's converts: with the folder's tokenizer
    when it has one (which must then match the weights), else with the vocabulary of the weights and
    a warning that training needs a tokenizer of that size."""
    from tokenizers import Tokenizer, models

    from canon_titan import cli

    no_tokenizer = ["--tokenizer.kind", "sentencepiece", "--tokenizer.path", str(tmp_path / "none")]
    run, step, _ = make_checkpoint(tmp_path, [*no_tokenizer, "--model.vocab_size", "128"])
    out = to_hf(step, tmp_path / "hf", run)
    assert not list(out.glob("tokenizer*"))

    def convert(name):
        code = cli.main(
            ["convert", "from-hf", str(out), str(tmp_path / name), "--config", str(CANON_CONFIG)]
        )
        return code, capsys.readouterr()

    code, printed = convert("weights")
    assert code == 0 and "has no tokenizer" in printed.out and "tokenizer of 128 ids" in printed.out
    original = dcp_tensors(step)
    assert original.keys() == dcp_tensors(tmp_path / "weights").keys()
    assert all(torch.equal(t, original[k]) for k, t in dcp_tensors(tmp_path / "weights").items())
    for size, expected in ((128, 0), (64, 2)):
        words = {f"w{i}": i for i in range(size)}
        Tokenizer(models.WordLevel(words, unk_token="w0")).save(str(out / "tokenizer.json"))
        code, printed = convert(f"tokenizer{size}")
        assert code == expected and "has no tokenizer" not in printed.out
    assert "vocab_size is 128, the run config expects 64" in printed.err
    assert all(
        torch.equal(t, original[k]) for k, t in dcp_tensors(tmp_path / "tokenizer128").items()
    )


def test_cli_convert_reports_errors(tmp_path, capsys):
    from canon_titan import cli

    code = cli.main(
        [
            "convert",
            "to-hf",
            str(tmp_path / "nope"),
            str(tmp_path / "out"),
            "--config",
            str(CANON_CONFIG),
        ]
    )
    assert code == 2 and "conversion error" in capsys.readouterr().err
    code = cli.main(
        [
            "convert",
            "to-hf",
            str(tmp_path),
            str(tmp_path / "out"),
            "--config",
            str(tmp_path / "x.toml"),
        ]
    )
    assert (
        code == 2 and "config error" in capsys.readouterr().err and not (tmp_path / "out").exists()
    )


def test_hf_classes_register_with_transformers_only_when_asked(tmp_path):
    """Importing canon_titan, the registry, the model families and the converter leaves transformers
    unimported; ``model_registry.register_with_transformers`` registers every family's model types,
    so an export loads without trust_remote_code."""
    run, step, _ = make_checkpoint(tmp_path, [])
    out = to_hf(step, tmp_path / "hf", run)
    script = (
        "import sys, canon_titan, model_registry, canon_titan.config, canon_titan.convert.hf\n"
        "for name in model_registry.FAMILIES:\n"
        "    model_registry.model_spec(name, 'debug')\n"
        "assert 'transformers' not in sys.modules\n"
        "model_registry.register_with_transformers()\n"
        "from transformers import AutoModelForCausalLM\n"
        f"print(type(AutoModelForCausalLM.from_pretrained({str(out)!r})).__module__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "canon_titan.hf.modeling_llama_canon"
