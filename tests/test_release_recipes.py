"""The recipes evaluate, checkpoint and seed as their release YAMLs do, and carry the release's
``zeyuan_layernorm``; ``[model] seed`` initialises the weights of a real run."""

import functools

import torch

from canon_titan.config import load
from conftest import COMMON, CONFIGS, REPO, run_training
from test_convert import dcp_tensors

TASKS_13 = [
    "hellaswag",
    "boolq",
    "piqa",
    "social_iqa",
    "winogrande",
    "openbookqa",
    "arc_easy",
    "arc_challenge",
    "race",
    "commonsense_qa",
    "copa",
    "lambada_openai",
    "triviaqa",
]
TASKS_14 = TASKS_13 + ["mmlu"]
# Read from the PhysicsLM4 release's YAMLs (github.com/facebookresearch/PhysicsLM4), one row per
# file: (checkpoint.dump.every, checkpoint.eval.every, eval.harness.tasks, model.zeyuan_layernorm
# (absent = false;
# None: the family has no such key)). Every YAML has seed 777, leaves model.seed and data.seed at
# Lingua's default, 42, and gives eval.harness no limit.
RELEASE = {
    "canon_llama_recipes/Llama-1B-Nemo-1T-lr0.002.yaml": (2000, 4000, TASKS_13, None),
    "canon_llama_recipes/Llama-1B-Nemo-1T-lr0.003.yaml": (2000, 4000, TASKS_13, None),
    "canon_llama_recipes/Llama-1B-Nemo-2T-lr0.003.yaml": (2000, 4000, TASKS_13, None),
    "canon_llama_recipes/Llama-1B-Nemo-2T-lr0.005.yaml": (2000, 4000, TASKS_13, None),
    "canon_llama_recipes/Llama-3B-Nemo-1T-lr0.002.yaml": (1000, 2000, TASKS_13, None),
    "canon_llama_recipes/Llama-3B-Nemo-1T-lr0.003.yaml": (1000, 2000, TASKS_13, None),
    "canon_llama_recipes/Llama-8B-Nemo-1T-lr0.002.yaml": (1000, 2000, TASKS_14, None),
    "canon_llama_recipes/Llama-8B-Nemo-1T-lr0.003.yaml": (1000, 2000, TASKS_14, None),
    "canon_llama_recipes/LlamaCanon-1B-Nemo-1T-lr0.002.yaml": (2000, 4000, TASKS_13, None),
    "canon_llama_recipes/LlamaCanon-1B-Nemo-1T-lr0.003.yaml": (2000, 4000, TASKS_13, None),
    "canon_llama_recipes/LlamaCanon-1B-Nemo-2T-lr0.003.yaml": (2000, 4000, TASKS_13, None),
    "canon_llama_recipes/LlamaCanon-1B-Nemo-2T-lr0.005.yaml": (2000, 4000, TASKS_13, None),
    "canon_llama_recipes/LlamaCanon-3B-Nemo-1T-lr0.002.yaml": (1000, 2000, TASKS_13, None),
    "canon_llama_recipes/LlamaCanon-3B-Nemo-1T-lr0.003.yaml": (1000, 2000, TASKS_13, None),
    "canon_llama_recipes/LlamaCanon-8B-Nemo-1T-lr0.002.yaml": (1000, 2000, TASKS_13, None),
    "canon_llama_recipes/LlamaCanon-8B-Nemo-1T-lr0.003.yaml": (1000, 2000, TASKS_13, None),
    "canon_linear_recipes/GDN2Canon-1B-Nemo-1T-lr0.002.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GDN2Canon-1B-Nemo-1T-lr0.003.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GDN2Canon-1B-Nemo-1T-lr0.005.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GDN2Canon-3B-Nemo-1T-lr0.002.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GDN2Canon-3B-Nemo-1T-lr0.003.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GDN2Canon-3B-Nemo-1T-lr0.005.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GDN2Canon-8B-Nemo-1T-lr0.002.yaml": (1500, 6000, TASKS_14, True),
    "canon_linear_recipes/GDN2Canon-8B-Nemo-1T-lr0.003.yaml": (1500, 6000, TASKS_14, True),
    "canon_linear_recipes/GDN2conv-1B-Nemo-1T-lr0.002.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GDN2conv-1B-Nemo-1T-lr0.003.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GDN2conv-1B-Nemo-1T-lr0.005.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GDN2conv-3B-Nemo-1T-lr0.002.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GDN2conv-3B-Nemo-1T-lr0.003.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GDN2conv-3B-Nemo-1T-lr0.005.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GDN2conv-8B-Nemo-1T-lr0.002.yaml": (1500, 6000, TASKS_14, True),
    "canon_linear_recipes/GDN2conv-8B-Nemo-1T-lr0.003.yaml": (1500, 6000, TASKS_14, True),
    "canon_linear_recipes/GLA5Canon-1B-Nemo-1T-lr0.002.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GLA5Canon-1B-Nemo-1T-lr0.003.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GLA5Canon-1B-Nemo-1T-lr0.005.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GLA5Canon-3B-Nemo-1T-lr0.002.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GLA5Canon-3B-Nemo-1T-lr0.003.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GLA5Canon-3B-Nemo-1T-lr0.005.yaml": (2000, 4000, TASKS_14, True),
    "canon_linear_recipes/GLA5Canon-8B-Nemo-1T-lr0.002.yaml": (1500, 6000, TASKS_14, True),
    "canon_linear_recipes/GLA5Canon-8B-Nemo-1T-lr0.003.yaml": (1500, 6000, TASKS_14, True),
    "canon_linear_recipes/GLA5conv-1B-Nemo-1T-lr0.002.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GLA5conv-1B-Nemo-1T-lr0.003.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GLA5conv-1B-Nemo-1T-lr0.005.yaml": (3000, 6000, TASKS_14, False),
    "canon_linear_recipes/GLA5conv-3B-Nemo-1T-lr0.002.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GLA5conv-3B-Nemo-1T-lr0.003.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GLA5conv-3B-Nemo-1T-lr0.005.yaml": (2000, 4000, TASKS_14, False),
    "canon_linear_recipes/GLA5conv-8B-Nemo-1T-lr0.002.yaml": (3000, 6000, TASKS_14, True),
    "canon_linear_recipes/GLA5conv-8B-Nemo-1T-lr0.003.yaml": (3000, 6000, TASKS_14, True),
    "canon_linear_recipes/Mamba2Canon-1B-Nemo-1T-lr0.002.yaml": (3000, 6000, TASKS_14, None),
    "canon_linear_recipes/Mamba2Canon-1B-Nemo-1T-lr0.003.yaml": (3000, 6000, TASKS_14, None),
    "canon_linear_recipes/Mamba2Canon-1B-Nemo-1T-lr0.005.yaml": (3000, 6000, TASKS_14, None),
    "canon_linear_recipes/Mamba2Canon-3B-Nemo-1T-lr0.002.yaml": (2000, 4000, TASKS_14, None),
    "canon_linear_recipes/Mamba2Canon-3B-Nemo-1T-lr0.003.yaml": (2000, 4000, TASKS_14, None),
    "canon_linear_recipes/Mamba2Canon-3B-Nemo-1T-lr0.005.yaml": (2000, 4000, TASKS_14, None),
    "canon_linear_recipes/Mamba2Canon-8B-Nemo-1T-lr0.002.yaml": (1500, 6000, TASKS_14, None),
    "canon_linear_recipes/Mamba2Canon-8B-Nemo-1T-lr0.003.yaml": (1500, 6000, TASKS_14, None),
    "canon_linear_recipes/Mamba2conv-1B-Nemo-1T-lr0.002.yaml": (3000, 6000, TASKS_14, None),
    "canon_linear_recipes/Mamba2conv-1B-Nemo-1T-lr0.003.yaml": (3000, 6000, TASKS_14, None),
    "canon_linear_recipes/Mamba2conv-1B-Nemo-1T-lr0.005.yaml": (3000, 6000, TASKS_14, None),
    "canon_linear_recipes/Mamba2conv-3B-Nemo-1T-lr0.002.yaml": (2000, 4000, TASKS_14, None),
    "canon_linear_recipes/Mamba2conv-3B-Nemo-1T-lr0.003.yaml": (2000, 4000, TASKS_14, None),
    "canon_linear_recipes/Mamba2conv-3B-Nemo-1T-lr0.005.yaml": (2000, 4000, TASKS_14, None),
    "canon_linear_recipes/Mamba2conv-8B-Nemo-1T-lr0.002.yaml": (3000, 6000, TASKS_14, None),
    "canon_linear_recipes/Mamba2conv-8B-Nemo-1T-lr0.003.yaml": (1500, 6000, TASKS_14, None),
}


def toml_name(yaml: str) -> str:
    return yaml.split("/")[1].removesuffix(".yaml").replace("conv-", "Conv-")


@functools.cache
def recipe(yaml: str):
    return load(REPO / "train_configs" / f"{toml_name(yaml)}.toml", environment=False)


def differences(found, expected) -> list[tuple[str, object, object]]:
    """(YAML, the recipe's value, the release's) wherever they differ."""
    return [
        (yaml, found(recipe(yaml)), want)
        for yaml, want in expected.items()
        if found(recipe(yaml)) != want
    ]


def test_every_recipe_has_its_release_yaml():
    assert {toml_name(y) for y in RELEASE} == {
        p.stem for p in (REPO / "train_configs").glob("*-Nemo-*.toml")
    }


def test_recipes_evaluate_as_their_yamls():
    """The release's tasks, cadence, and every item (limit 0)."""
    assert not differences(
        lambda run: (run["eval"]["every"], run["eval"]["tasks"], run["eval"]["limit"]),
        {y: (every, tasks, 0) for y, (_, every, tasks, _) in RELEASE.items()},
    )


def test_recipes_checkpoint_as_their_yamls():
    assert not differences(
        lambda run: run["checkpoint"]["interval"], {y: row[0] for y, row in RELEASE.items()}
    )


def test_recipes_seed_as_the_release():
    """[job] seed 777 (the release's run seed), [model] seed 42 (its model.seed: the weights),
    [dataloader] seed 42 (its data.seed)."""
    assert not differences(
        lambda run: (run["job"]["seed"], run.model_args.seed, run["dataloader"]["seed"]),
        dict.fromkeys(RELEASE, (777, 42, 42)),
    )


def test_linear_recipes_carry_the_release_zeyuan_layernorm():
    assert not differences(
        lambda run: getattr(run.model_args, "zeyuan_layernorm", None),
        {y: row[3] for y, row in RELEASE.items()},
    )


def test_model_seed_initialises_the_weights(tmp_path):
    """A run's initial weights come from [model] seed, not [job] seed: they equal the model built
    and initialised by hand after torch.manual_seed([model] seed)."""
    run_training(
        1,
        COMMON
        + [
            "--job.dump_folder",
            str(tmp_path),
            "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint",
            "--model.seed",
            "5",
            "--job.seed",
            "9",
        ],
        config=CONFIGS["llama_canon"],
    )
    saved = dcp_tensors(tmp_path / "checkpoint" / "step-0")
    run = load(CONFIGS["llama_canon"], COMMON, environment=False)
    for seed, same in ((5, True), (9, False)):
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = run.model_spec().model.build()
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_states()
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items()) == same
