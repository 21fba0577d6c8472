"""Every released Llama/LlamaCanon recipe resolves to the values of spec section 4.2."""

import pytest

from canon_titan.config import load
from conftest import REPO

# name: (gpus, bs/gpu, steps, lr, wd, warmup) -- transcribed from the spec's per-file table.
RECIPES = {
    "Llama-1B-Nemo-1T-lr0.002": (128, 8, 240000, 0.002, 0.02, 8000),
    "Llama-1B-Nemo-1T-lr0.003": (128, 8, 240000, 0.003, 0.0133, 8000),
    "Llama-1B-Nemo-2T-lr0.003": (256, 8, 240000, 0.003, 0.0133, 8000),
    "Llama-1B-Nemo-2T-lr0.005": (256, 8, 240000, 0.005, 0.008, 8000),
    "LlamaCanon-1B-Nemo-1T-lr0.002": (128, 8, 240000, 0.002, 0.02, 8000),
    "LlamaCanon-1B-Nemo-1T-lr0.003": (128, 8, 240000, 0.003, 0.0133, 8000),
    "LlamaCanon-1B-Nemo-2T-lr0.003": (256, 8, 240000, 0.003, 0.0133, 8000),
    "LlamaCanon-1B-Nemo-2T-lr0.005": (256, 8, 240000, 0.005, 0.008, 8000),
    "Llama-3B-Nemo-1T-lr0.002": (256, 6, 160000, 0.002, 0.03, 4000),
    "Llama-3B-Nemo-1T-lr0.003": (256, 6, 160000, 0.003, 0.02, 4000),
    "LlamaCanon-3B-Nemo-1T-lr0.002": (256, 6, 160000, 0.002, 0.03, 4000),
    "LlamaCanon-3B-Nemo-1T-lr0.003": (256, 6, 160000, 0.003, 0.02, 4000),
    "Llama-8B-Nemo-1T-lr0.002": (512, 3, 160000, 0.002, 0.03, 3000),
    "Llama-8B-Nemo-1T-lr0.003": (512, 3, 160000, 0.003, 0.02, 3000),
    "LlamaCanon-8B-Nemo-1T-lr0.002": (512, 3, 160000, 0.002, 0.03, 3000),
    "LlamaCanon-8B-Nemo-1T-lr0.003": (512, 3, 160000, 0.003, 0.02, 3000),
}
# size: (dim, layers, heads, kv, ffn, vocab, theta, qk_norm, z_loss, canon rope_dim)
SHAPES = {
    "1B": (2048, 24, 32, 32, 5632, 32000, 1e4, True, True, 16),
    "3B": (3072, 26, 24, 24, 8192, 32000, 1e4, True, True, 32),
    "8B": (4096, 32, 32, 8, 14336, 128256, 1e5, False, False, 32),
}


def test_all_sixteen_recipes_exist():
    files = {p.stem for p in (REPO / "train_configs").glob("Llama*-Nemo-*.toml")}
    assert files == set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_resolves_to_spec(name):
    gpus, bs, steps, lr, wd, warmup = RECIPES[name]
    size = name.split("-")[1]
    dim, layers, heads, kv, ffn, vocab, theta, qk_norm, z_loss, canon_rope = SHAPES[size]
    run = load(REPO / "train_configs" / f"{name}.toml", environment=False)
    args, training, opt, sched = (
        run.model_args,
        run["training"],
        run["optimizer"],
        run["lr_scheduler"],
    )
    canon = name.startswith("LlamaCanon")
    assert run["model"]["name"] == ("llama_canon" if canon else "llama")
    assert (
        args.dim,
        args.n_layers,
        args.n_heads,
        args.kv_heads,
        args.hidden_dim,
        args.vocab_size,
    ) == (dim, layers, heads, kv, ffn, vocab)
    assert args.rope_theta == theta and args.qk_norm == qk_norm and args.z_loss == z_loss
    assert getattr(args, "canon_set", "") == ("ABCD" if canon else "")
    assert (args.rope_dim or args.head_dim) == (canon_rope if canon else args.head_dim)
    assert training["seq_len"] == 4096 and training["steps"] == steps
    assert training["local_batch_size"] == bs and training["global_batch_size"] == gpus * bs
    assert training["max_norm"] == 1.0 and training["mixed_precision_param"] == "bfloat16"
    assert opt["name"] == "AdamW" and opt["lr"] == lr and opt["weight_decay"] == wd
    assert opt["betas"] == [0.9, 0.95] and opt["eps"] == 1e-8
    assert (
        sched["warmup_steps"] == warmup
        and sched["decay_type"] == "cosine"
        and sched["min_lr_factor"] == 0.01
    )
    assert run["compile"]["enable"] and run["activation_checkpoint"]["mode"] == "none"
    assert run["job"]["seed"] == 777
    assert ("llama3" if size == "8B" else "llama2") in run["tokenizer"]["path"]
    assert run["tokenizer"]["kind"] == ("tiktoken" if size == "8B" else "sentencepiece")
    assert run["dataloader"]["dataset"] == "tokens"


# Linear recipes (spec 5.7). size: (gpus, seq_len, steps, warmup, [(lr, wd), ...], dim, layers,
# heads, mlp, vocab)
LINEAR_SIZES = {
    "1B": (
        128,
        16384,
        480000,
        12000,
        [(0.002, 0.01), (0.003, 0.00667), (0.005, 0.004)],
        2048,
        24,
        16,
        4096,
        32000,
    ),
    "3B": (
        256,
        12288,
        320000,
        8000,
        [(0.002, 0.005), (0.003, 0.01), (0.005, 0.006)],
        3072,
        26,
        24,
        6144,
        32000,
    ),
    "8B": (512, 4096, 480000, 9000, [(0.002, 0.01), (0.003, 0.00667)], 4096, 32, 32, 9472, 128256),
}
LINEAR_ARCHS = {"GLA5": "gla5", "GDN2": "gdn2", "Mamba2": "mamba2"}
LINEAR_VARIANTS = {"Canon": "AbbCD", "Conv": "bb"}
LINEAR_RECIPES = {
    f"{arch}{variant}-{size}-Nemo-1T-lr{lr}": (arch, variant, size, lr, wd)
    for arch in LINEAR_ARCHS
    for variant in LINEAR_VARIANTS
    for size, spec in LINEAR_SIZES.items()
    for lr, wd in spec[4]
}


def test_all_48_linear_recipes_exist():
    assert len(LINEAR_RECIPES) == 48
    files = {
        p.stem
        for p in (REPO / "train_configs").glob("*-Nemo-*.toml")
        if not p.stem.startswith("Llama")
    }
    assert files == set(LINEAR_RECIPES)


@pytest.mark.parametrize("name", sorted(LINEAR_RECIPES))
def test_linear_recipe_resolves_to_spec(name):
    arch, variant, size, lr, wd = LINEAR_RECIPES[name]
    gpus, seq_len, steps, warmup, _, dim, layers, heads, mlp, vocab = LINEAR_SIZES[size]
    run = load(REPO / "train_configs" / f"{name}.toml", environment=False)
    args, training, opt, sched = (
        run.model_args,
        run["training"],
        run["optimizer"],
        run["lr_scheduler"],
    )
    assert run["model"]["name"] == LINEAR_ARCHS[arch] and args.canon_set == LINEAR_VARIANTS[variant]
    assert (args.dim, args.n_layers, args.n_heads, args.hidden_dim, args.vocab_size) == (
        dim,
        layers,
        heads,
        mlp,
        vocab,
    )
    assert args.norm_eps == 1e-5 and not args.z_loss
    if arch == "Mamba2":
        assert args.state_size == 128 and args.head_dim == 256
    assert training["local_batch_size"] == 1 and training["global_batch_size"] == gpus
    assert training["seq_len"] == seq_len and training["steps"] == steps
    assert gpus * seq_len * steps == pytest.approx(1.0e12, rel=0.01)  # 1T tokens
    assert training["max_norm"] == 1.0 and training["mixed_precision_param"] == "bfloat16"
    assert opt["name"] == "AdamW" and opt["lr"] == lr and opt["weight_decay"] == wd
    assert opt["betas"] == [0.9, 0.95] and opt["eps"] == 1e-8
    assert (
        sched["warmup_steps"] == warmup
        and sched["decay_type"] == "cosine"
        and sched["min_lr_factor"] == 0.01
    )
    assert run["compile"]["enable"] and run["job"]["seed"] == 777
    assert not run["dataloader"]["document_masking"] and run["dataloader"]["dataset"] == "tokens"
    assert run["tokenizer"]["kind"] == ("tiktoken" if size == "8B" else "sentencepiece")
    # Checkpoint and eval cadence, seeds: test_release_recipes.py, per release YAML.


def test_every_config_header_launches_it_through_the_project_s_launcher():
    """Each train_configs file's header names how to run it, and that launch path is one that
    reports a stop with the project's exit codes (`canon-titan train`, scripts/run_train.sh,
    scripts/playground.sh): never the plain torchrun line (which turns a preemption into torchrun's
    failure report and exit 1), as the debug configs' headers showed at 432670c."""
    import re

    files = sorted((REPO / "train_configs").rglob("*.toml"))
    assert len(files) > 70
    for path in files:
        header = "".join(
            line for line in path.read_text().splitlines(keepends=True) if line.startswith("#")
        )
        assert "torchrun" not in header and "-m canon_titan.train" not in header, path
        run = re.search(r"Run: (.*)", header)
        assert run, f"{path}: no 'Run:' line in its header"
        own = str(path.relative_to(REPO))
        assert (
            f"canon-titan train --config {own} " in run.group(1)
            or run.group(1).startswith(f"CONFIG={own} NGPU=8 scripts/run_train.sh")
            or run.group(1).startswith("scripts/playground.sh")
            or run.group(1).startswith(f"canon-titan sweep {own}")
        ), (path, run.group(1))
