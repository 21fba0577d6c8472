"""DCP <-> Hugging Face conversion of the linear models (GLA5, GDN2, Mamba2): the release's tensor
names and config fields, our transformers classes against canon-titan's forward, cached decoding,
round trips, and loading the export without canon-titan."""

import json
import subprocess
import sys

import pytest
import torch

from canon_titan.config import load
from canon_titan.convert.dcp_io import (
    ConversionError,
    find_step_dir,
    load_tensor,
    model_tensor_metadata,
)
from canon_titan.convert.hf import dcp_to_hf_model, from_hf, to_hf
from conftest import REPO, make_checkpoint
from model_registry import register_with_transformers

FAMILIES = ("gla5", "gdn2", "mamba2")
CONFIGS = {family: REPO / "train_configs" / f"{family}_debug.toml" for family in FAMILIES}
ARCHITECTURES = {
    "gla5": ("GLACanon", "GLACanonForCausalLM", "configuration_gla_canon", "modeling_gla_canon"),
    "gdn2": (
        "GatedDeltaNetCanon",
        "GatedDeltaNetCanonForCausalLM",
        "configuration_gated_deltanet_canon",
        "modeling_gated_deltanet_canon",
    ),
    "mamba2": (
        "Mamba2Canon",
        "Mamba2CanonForCausalLM",
        "configuration_mamba2_canon",
        "modeling_mamba2_canon",
    ),
}
CASES = [(family, canon_set) for family in FAMILIES for canon_set in ("AbbCD", "bb")] + [
    ("mamba2", ""),
    ("gdn2", "AC"),
]
# 80 tokens: more than one 64-token chunk of every kernel, canon-titan's and the HF classes'.
TOKENS = torch.randint(0, 700, (2, 80), generator=torch.Generator().manual_seed(1))
SHARD_BYTES = 300_000  # several shards for the debug models


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(run, DCP step folder, canon-titan model, HF folder) per (family, canon_set), made once."""
    made = {}

    def get(family, canon_set):
        if (family, canon_set) not in made:
            tmp = tmp_path_factory.mktemp(f"{family}_{canon_set or 'none'}")
            run, step, model = make_checkpoint(
                tmp, ["--model.canon_set", canon_set], config=CONFIGS[family]
            )
            made[family, canon_set] = (
                run,
                step,
                model,
                to_hf(step, tmp / "hf", run, max_shard_size=SHARD_BYTES),
            )
        return made[family, canon_set]

    return get


def hf_model(out_dir):
    from transformers import AutoModelForCausalLM

    register_with_transformers()
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


def assert_logits_close(logits, reference):
    torch.testing.assert_close(
        logits, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item()
    )


def dcp_tensors(step_dir):
    step_dir = find_step_dir(step_dir)
    return {k: load_tensor(step_dir, k, m) for k, m in model_tensor_metadata(step_dir).items()}


def hf_weights(out_dir):
    from safetensors.torch import load_file

    return {
        k: v for f in sorted(out_dir.glob("model-*.safetensors")) for k, v in load_file(f).items()
    }


@pytest.mark.parametrize("family,canon_set", CASES)
def test_exported_logits_match_canon_titan(export, family, canon_set):
    run, _, model, out = export(family, canon_set)
    model_type, architecture, config_module, modeling_module = ARCHITECTURES[family]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and config["architectures"] == [architecture]
    assert config["auto_map"] == {
        "AutoConfig": f"{config_module}.{model_type}Config",
        "AutoModelForCausalLM": f"{modeling_module}.{architecture}",
    }
    assert (
        config["canon_set"] == canon_set
        and config["max_position_embeddings"] == run["training"]["seq_len"]
    )
    for name in (config_module, modeling_module, "linear_canon_layers"):
        assert (out / f"{name}.py").is_file()
    hf = hf_model(out)
    with torch.no_grad():
        logits, reference = hf(TOKENS).logits, model(TOKENS)
    assert type(hf).__name__ == architecture
    assert_logits_close(logits, reference)

    weights = hf_weights(out)
    b, d = "b" in canon_set, run.model_args.dim
    hidden = run.model_args.hidden_dim
    prefix = "backbone" if family == "mamba2" else "model"
    assert {"lm_head.weight", f"{prefix}.embeddings.weight"} <= weights.keys()
    layer = f"{prefix}.layers.1."
    assert (layer + "canonA.weight" in weights) == ("A" in canon_set)
    assert (layer + "mlp.canonD.weight" in weights) == ("D" in canon_set)
    if family == "mamba2":
        assert (
            f"{prefix}.norm_f.weight" in weights and layer + "pre_mlp_layernorm.weight" in weights
        )
        assert weights[layer + "mlp.both_proj.weight"].shape == (2 * hidden, d)
        conv = weights[layer + "mixer.conv1d.weight"]
        assert (layer + "mixer.conv1d.bias" in weights) == b and config["noconv1d"] == (not b)
        if not b:  # the release's frozen identity kernel
            assert torch.equal(conv, torch.zeros_like(conv).index_fill_(2, torch.tensor([3]), 1.0))
        return
    assert f"{prefix}.norm.weight" in weights and layer + "attn_norm.weight" in weights
    assert weights[layer + "attn.g_proj.0.weight"].shape == (16, d)
    assert weights[layer + "attn.g_proj.1.bias"].shape == (2 * d,)
    assert (layer + "attn.q_conv1d.weight" in weights) == b and config["use_short_conv"] == b
    if family == "gla5":
        assert {
            layer + "attn.gk_proj.0.weight",
            layer + "attn.g_norm_swish_gate.weight",
        } <= weights.keys()
        assert weights[layer + "mlp.gate_proj.weight"].shape == (2 * hidden, d)  # [gate | up]
    elif "D" in canon_set:
        assert weights[layer + "mlp.both_proj.weight"].shape == (2 * hidden, d)
    else:
        assert {
            layer + "mlp.gate_proj.weight",
            layer + "mlp.up_proj.weight",
            layer + "attn.A_log",
            layer + "attn.o_norm.weight",
        } <= weights.keys()


@pytest.mark.parametrize("family,canon_set", CASES)
def test_round_trip_is_bit_identical(export, tmp_path, family, canon_set):
    run, step, _, out = export(family, canon_set)
    assert len(list(out.glob("model-*.safetensors"))) > 1  # several shards
    back = from_hf(out, tmp_path / "back", run)
    original, restored = dcp_tensors(step), dcp_tensors(back)
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_in_memory_conversion_equals_the_export(export, family):
    run, step, _, out = export(family, "AbbCD")
    in_memory = dcp_to_hf_model(step, run, dtype="fp32")
    with torch.no_grad():
        logits, exported = in_memory(TOKENS).logits, hf_model(out)(TOKENS).logits
    assert type(in_memory).__name__ == ARCHITECTURES[family][1] and not in_memory.training
    torch.testing.assert_close(logits, exported, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_cache_equals_argmax_loop(export, family):
    model = hf_model(export(family, "AbbCD")[3])
    prompt = TOKENS[:1, :7]
    model.generation_config.eos_token_id = None  # compare 24 raw greedy steps, no early stop
    generated = model.generate(prompt, max_new_tokens=24, do_sample=False, use_cache=True)
    sequence = prompt
    with torch.no_grad():
        for _ in range(24):
            next_token = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
        assert torch.equal(generated, sequence)
        assert len(set(sequence[0, 7:].tolist())) > 5  # a non-degenerate continuation
        # Prefill, then one token at a time, equals one pass over everything.
        prefill = model(TOKENS[:, :50], use_cache=True)
        cache, steps = prefill.past_key_values, [prefill.logits]
        for t in range(50, 58):
            out = model(TOKENS[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
        full = model(TOKENS[:, :58], use_cache=False).logits
    assert cache.get_seq_length() == 58
    assert_logits_close(torch.cat(steps, dim=1), full)


# Without Canon-A (which zeroes the whole mixer input at padded positions) and, for GLA5/GDN2,
# without b, so the mixers' own masking is what keeps padding out of the state.
@pytest.mark.parametrize("family,canon_set", [("gla5", ""), ("gdn2", ""), ("mamba2", "bb")])
def test_left_padding_does_not_change_the_real_tokens(export, family, canon_set):
    model = hf_model(export(family, canon_set)[3])
    pad = 5
    tokens = torch.cat([torch.zeros(2, pad, dtype=torch.long), TOKENS[:, :30]], dim=1)
    mask = torch.ones_like(tokens)
    mask[0, :pad] = 0  # row 0 left-padded, row 1 starts with 5 real tokens
    with torch.no_grad():
        padded = model(tokens, attention_mask=mask).logits
        alone = model(TOKENS[:1, :30]).logits
    assert_logits_close(padded[:1, pad:], alone)


def test_gla_release_layernorm_names_import(export, tmp_path):
    """A release GLA5 trained with ``zeyuan_layernorm`` names its gated norm ``attn.g_norm``."""
    from safetensors.torch import save_file

    run, step, _, out = export("gla5", "AbbCD")
    release = tmp_path / "release"
    release.mkdir()
    weights = {k.replace("g_norm_swish_gate", "g_norm"): v for k, v in hf_weights(out).items()}
    save_file(weights, str(release / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({**config, "zeyuan_layernorm": True}))
    back = from_hf(release, tmp_path / "back", run)
    original, restored = dcp_tensors(step), dcp_tensors(back)
    assert all(torch.equal(original[k], restored[k]) for k in original)
    from transformers import AutoModelForCausalLM

    register_with_transformers()
    model = AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(TOKENS).logits, hf_model(out)(TOKENS).logits, rtol=0, atol=0
        )


@pytest.mark.parametrize("family", ["gla5", "gdn2"])
def test_zeyuan_layernorm_exports_and_round_trips(tmp_path, family):
    """A run with ``zeyuan_layernorm`` (the release's 8B recipes) writes it into config.json, and
    GLA5 the release's name for its gated norm, so the release's class builds those modules; the
    folder imports back to the same tensors, whose export writes the same config.json."""
    run, step, model = make_checkpoint(
        tmp_path, ["--model.zeyuan_layernorm", "true"], config=CONFIGS[family]
    )
    out = to_hf(step, tmp_path / "hf", run)
    config = json.loads((out / "config.json").read_text())
    assert config["zeyuan_layernorm"] is True
    if family == "gla5":
        names = set(hf_weights(out))
        assert "model.layers.0.attn.g_norm.weight" in names and not any(
            "g_norm_swish_gate" in n for n in names
        )
    with torch.no_grad():
        assert_logits_close(hf_model(out)(TOKENS).logits, model(TOKENS))
    back = from_hf(out, tmp_path / "back", run)
    original, restored = dcp_tensors(step), dcp_tensors(back)
    assert original.keys() == restored.keys() and all(
        torch.equal(original[k], restored[k]) for k in original
    )
    assert json.loads((to_hf(back, tmp_path / "again", run) / "config.json").read_text()) == config


def test_from_hf_rejects_another_model(export, tmp_path):
    run, _, _, out = export("gla5", "AbbCD")
    with pytest.raises(ConversionError, match="canon_set is 'AbbCD', the run config expects 'bb'"):
        from_hf(
            out,
            tmp_path / "a",
            load(CONFIGS["gla5"], ["--model.canon_set", "bb"], environment=False),
        )
    with pytest.raises(ConversionError, match="model_type 'GLACanon' is not 'GatedDeltaNetCanon'"):
        from_hf(
            out,
            tmp_path / "b",
            load(CONFIGS["gdn2"], ["--model.canon_set", "AbbCD"], environment=False),
        )
    with pytest.raises(ConversionError, match="num_hidden_layers is 4, the run config expects 2"):
        from_hf(
            out, tmp_path / "c", load(CONFIGS["gla5"], ["--model.n_layers", "2"], environment=False)
        )
    assert not any((tmp_path / n).exists() for n in "abc")


def test_remote_code_loads_without_canon_titan(export, tmp_path):
    outs = {}
    for family in FAMILIES:
        _, _, model, out = export(family, "AbbCD")
        with torch.no_grad():
            torch.save(model(TOKENS), tmp_path / f"{family}.pt")
        outs[family] = str(out)
    torch.save(TOKENS, tmp_path / "tokens.pt")
    script = f"""
import sys, torch
sys.modules["canon_titan"] = None  # make any import of canon-titan fail
from transformers import AutoModelForCausalLM
tokens = torch.load({str(tmp_path / "tokens.pt")!r})
for family, out in {outs!r}.items():
    m = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                             dtype=torch.float32).eval()
    assert m.__class__.__module__.startswith("transformers_modules"), m.__class__.__module__
    with torch.no_grad():
        logits = m(tokens).logits
    ref = torch.load({str(tmp_path)!r} + f"/{{family}}.pt")
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    generated = m.generate(tokens[:1, :5], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 9), generated.shape
print("remote-ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert "remote-ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
