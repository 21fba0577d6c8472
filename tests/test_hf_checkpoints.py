"""Hugging Face checkpoints through each family's TorchTitan ``StateDictAdapter``: the adapter on
live state dicts against ``canon-titan convert`` (which reads DCP files tensor by tensor);
TorchTitan's
``[checkpoint] last_save_in_hf`` and ``initial_load_in_hf`` in real trainings (FSDP-sharded
DTensors with two processes) against the converter, transformers and a start from the converted
DCP; and checkpoints written before the model families moved into their folders."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from canon_titan.components.metrics import read_scalars
from canon_titan.config import load
from canon_titan.convert.dcp_io import load_model
from canon_titan.convert.hf import from_hf, to_hf
from conftest import COMMON, REPO, make_checkpoint, run_training
from model_registry import register_with_transformers

CONFIG = {
    name: REPO / "train_configs" / f"{name}_debug.toml"
    for name in ("llama", "llama_canon", "gla5", "gdn2", "mamba2")
}
TOKENS = torch.randint(0, 700, (2, 24), generator=torch.Generator().manual_seed(3))
LEGACY = REPO / "tests" / "assets" / "legacy_checkpoints"


def export_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def assert_same(found: dict, expected: dict) -> None:
    assert sorted(found) == sorted(expected)
    different = [k for k in expected if not torch.equal(found[k].float(), expected[k].float())]
    assert not different, different


ADAPTER_CASES = [
    (
        "llama",
        ["--model.qk_norm", "false"],
        "lingua",
    ),  # transformers' LlamaForCausalLM: rotate-half q/k
    ("llama", [], "lingua"),  # QK-norm: LlamaCanon classes
    ("llama_canon", ["--model.canon_bias", "true"], "lingua"),
    ("llama_canon", [], "huggingface"),  # q/k, QK-norm and Canon-B rows reordered
    ("gla5", [], "lingua"),  # fused [gate | up]
    ("gdn2", ["--model.canon_set", "AbbC"], "lingua"),  # separate gate/up without Canon-D
    ("mamba2", ["--model.canon_set", "AC"], "lingua"),  # the frozen identity convolution
]


@pytest.mark.parametrize("family,overrides,layout", ADAPTER_CASES)
def test_adapter_on_a_live_state_dict_matches_the_converter(tmp_path, family, overrides, layout):
    run, step, model = make_checkpoint(tmp_path, overrides, config=CONFIG[family], seed=2)
    exported = export_tensors(to_hf(step, tmp_path / "hf", run, rope_layout=layout))
    adapter = run.state_dict_adapter(rope_layout=layout)
    state = model.state_dict()
    assert_same(adapter.to_hf(state), exported)
    assert_same(adapter.from_hf(exported), state)


def test_adapter_to_hf_on_one_pipeline_stage_names_only_its_tensors(tmp_path):
    run, _, model = make_checkpoint(tmp_path, ["--model.canon_set", "AC"], config=CONFIG["mamba2"])
    stage = {k: v for k, v in model.state_dict().items() if k.startswith("layers.1.")}
    hf = run.state_dict_adapter().to_hf(stage)
    assert hf and all(name.startswith("backbone.layers.1.") for name in hf)
    assert (
        "backbone.layers.1.mixer.conv1d.weight" in hf
    )  # the identity kernel of this stage's layer


def _train(nproc: int, family: str, dump: Path, *extra: str) -> dict[int, float]:
    run_training(
        nproc,
        COMMON + ["--training.seq_len", "64", "--job.dump_folder", str(dump), *extra],
        config=CONFIG[family],
    )
    return read_scalars(str(dump))


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,overrides,nproc,restart",
    [
        (
            "llama",
            ["--model.qk_norm", "false"],
            2,
            True,
        ),  # sharded q/k rows reordered to rotate-half
        ("gla5", [], 2, False),  # sharded w1 and w3 joined
    ],
)
def test_last_save_in_hf_and_initial_load_in_hf(tmp_path, family, overrides, nproc, restart):
    """A run saving its last step in HF writes what `convert to-hf` makes of the same weights as
    DCP, a folder transformers loads with canon-titan's logits; a run started from it with
    initial_load_in_hf trains exactly as one started from `convert from-hf` of it (checked for
    llama: each start is two more trainings; the other families' adapters read HF tensors the same
    way, checked on live state dicts above)."""
    checkpoint = [
        *overrides,
        "--training.steps",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.last_save_model_only",
    ]
    saved = tmp_path / "saved"
    _train(nproc, family, saved, *checkpoint, "--checkpoint.last_save_in_hf")
    hf_dir = saved / "checkpoint" / "step-2"
    assert not (hf_dir / ".metadata").exists() and not (hf_dir / "sharded").exists()
    # The same last step saved as DCP: step 1 of the run above, resumed.
    again = tmp_path / "again"
    shutil.copytree(saved, again, ignore=shutil.ignore_patterns("step-2", "tb"))
    _train(nproc, family, again, *checkpoint)
    run = load(CONFIG[family], [*overrides, "--training.seq_len", "64"], environment=False)
    export = to_hf(again / "checkpoint" / "step-2", tmp_path / "export", run)
    assert_same(export_tensors(hf_dir), export_tensors(export))
    assert json.loads((hf_dir / "config.json").read_text()) == json.loads(
        (export / "config.json").read_text()
    )
    for name in (
        p.name for p in export.iterdir() if p.suffix in (".py", ".json") and "index" not in p.name
    ):
        assert (hf_dir / name).is_file(), name

    from transformers import AutoModelForCausalLM

    register_with_transformers()
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    titan = load_model(run, again / "checkpoint" / "step-2")
    with torch.no_grad():
        reference = titan(TOKENS)
        torch.testing.assert_close(
            hf_model(TOKENS).logits, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item()
        )

    if not restart:
        return
    converted = from_hf(hf_dir, tmp_path / "converted", run)
    start = [
        *overrides,
        "--training.steps",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "10",
    ]
    from_hf_folder = _train(
        nproc,
        family,
        tmp_path / "from_hf",
        *start,
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(hf_dir),
    )
    from_dcp = _train(
        nproc,
        family,
        tmp_path / "from_dcp",
        *start,
        "--checkpoint.initial_load_path",
        str(converted),
    )
    assert sorted(from_hf_folder) == [1, 2]
    assert from_hf_folder == from_dcp


@pytest.mark.parametrize("family", sorted(CONFIG))
def test_checkpoints_written_before_the_move_still_load(tmp_path, family):
    """Tiny DCP checkpoints (one layer, dim 16, the built-in tokenizer's 784 ids, weights perturbed
    off their init) written by the code before the model families moved into their folders: the
    current model loads every tensor by name and shape, and their HF export computes the same logits
    in transformers."""
    overrides = json.loads((LEGACY / "overrides.json").read_text())[family]
    run = load(
        CONFIG[family],
        [f"--model.{k}={json.dumps(v)}" for k, v in overrides.items()],
        environment=False,
    )
    model = load_model(run, LEGACY / family)
    out = to_hf(LEGACY / family, tmp_path / "hf", run)

    from transformers import AutoModelForCausalLM

    register_with_transformers()
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(TOKENS)
        torch.testing.assert_close(
            hf_model(TOKENS).logits, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item()
        )
