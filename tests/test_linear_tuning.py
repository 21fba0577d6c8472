"""The linear models' first-step kernel tuning (``canon_titan/kernels/tuning.py``,
``canon_titan/models/common/linear_tuning.py``): the narrowed searches against the H200's timings of
every configuration, on the GPU's own candidate lists at the recipes' shapes; the pass before the
first collective makes exactly the first step's kernel calls and reports each kernel it tunes; and a
rank slower to tune than the collectives' timeout does not end a multi-process run."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model_registry
from canon_titan.kernels import tuning
from canon_titan.kernels.backends import KernelEnvironment, planned_machine
from canon_titan.models.common import linear_tuning
from conftest import COMMON, REPO, torchrun_cmd, train_env

H200_TUNING = REPO / "scripts" / "benchmarks" / "gpu_check_tuned.json"
KEEPS = {name: keep for kernels in tuning.NARROWED.values() for name, keep in kernels.items()}


def test_the_narrowed_searches_keep_the_h200_winners():
    """Every timing of every configuration of fla's kernels that an H200 lease measured (2026-11-28,
    Triton 3.6; the 1B runs' entries are the ones whose tuning key holds GLA5-1B's key head size,
    128): at the 1B shapes the narrowed search keeps the winner (within 1%), at the debug shapes a
    configuration within 15%."""
    from triton import Config

    checked = at_1b = 0
    for path, text in json.loads(H200_TUNING.read_text()).items():
        name = path.split("/")[1].removesuffix(".autotune.json")
        if name not in KEEPS:
            continue
        entry = json.loads(text)
        timings = {Config(**config): times[0] for config, times in entry["configs_timings"]}
        kept = KEEPS[name](list(timings))
        assert 0 < len(kept) < len(timings), name
        best, kept_best = min(timings.values()), min(timings[c] for c in kept)
        recipe_shape = 128 in entry["key"]
        assert kept_best <= best * (1.01 if recipe_shape else 1.15), (
            name,
            entry["key"],
            kept_best,
            best,
        )
        checked, at_1b = checked + 1, at_1b + recipe_shape
    assert checked >= 10 and at_1b >= 4


HOPPER_LISTS = """
import importlib, importlib.metadata, importlib.util, json, os, sys, types
# fla's and fla.ops' __init__ import every op of fla (minutes on a busy 2-core machine): as empty
# packages here, only the modules read below and what they import are, once, and after the checks
# their candidate lists are built from say what fla finds on an H100/H200 (227 KB of shared memory,
# sm_90), rebuilt here without one.
root = importlib.util.find_spec("fla").submodule_search_locations[0]
for name, folder in (("fla", root), ("fla.ops", os.path.join(root, "ops"))):
    sys.modules[name] = package = types.ModuleType(name)
    package.__path__ = [folder]
sys.modules["fla"].__version__ = importlib.metadata.version("fla-core")
import fla.utils, fla.utils.hardware as hardware
fla.utils.check_shared_mem = hardware.check_shared_mem = lambda arch="none", tensor_idx=0: True
fla.utils.IS_NVIDIA_HOPPER = hardware.IS_NVIDIA_HOPPER = True
from canon_titan.kernels import tuning
assert not [name for name in tuning.NARROWED if name in sys.modules], "imported before the checks"
out = {}
for module_name, kernels in tuning.NARROWED.items():
    module = importlib.import_module(module_name)
    for name, keep in kernels.items():
        tuner = tuning.autotuner_of(getattr(module, name))
        shape = dict(K=128, V=256, STATE_V_FIRST=False)
        offered = tuner.early_config_prune(tuner.configs, shape) \\
            if tuner.early_config_prune else tuner.configs
        out[name] = [len(tuner.configs), len(keep(offered))]
print(json.dumps(out))
"""
GLA = (
    "chunk_local_cumsum_vector_kernel",
    "chunk_fwd_kernel_h",
    "chunk_gla_fwd_A_kernel_intra_sub_inter",
    "chunk_gla_fwd_A_kernel_intra_sub_intra",
    "chunk_gla_fwd_kernel_o",
    "chunk_bwd_kernel_dh",
    "chunk_gla_bwd_kernel_dv",
    "chunk_gla_bwd_kernel_dA",
    "chunk_gla_bwd_kernel_intra",
    "chunk_gla_bwd_kernel_inter",
)
"""The autotuned kernels of one GLA forward and backward (as the interpreter test below records
them)."""


def test_on_hoppers_candidate_lists_gla_times_28_configurations_of_266():
    """fla's candidate lists as it builds them on Hopper, at GLA5-1B's head sizes (key 128, value
    256, where fla's own pruning of the backward tiles keeps all 36): the forward and backward time
    28 configurations instead of 266; the gated delta rule's kernels 18 instead of 61 (its output
    kernel's 3 stay as fla lists them)."""
    proc = subprocess.run(
        [sys.executable, "-c", HOPPER_LISTS],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    gla = [counts[name] for name in GLA]
    assert sum(c[0] for c in gla) == 266 and sum(c[1] for c in gla) == 28
    gdn = [
        counts[name]
        for name in counts
        if name not in GLA and name != "chunk_local_cumsum_vector_kernel"
    ]
    assert sum(c[0] for c in gdn) == 61 and sum(c[1] for c in gdn) == 18


class _Calls(TorchDispatchMode):
    """canon_titan's custom-op calls: name and every argument (tensors as shape, stride and
    dtype)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "canon_titan":
            self.calls.append(
                (
                    func._opname,
                    tuple(
                        (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                        for a in args
                    ),
                )
            )
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["gla5", "gdn2", "mamba2"])
def test_the_tuning_pass_makes_the_first_steps_kernel_calls(family):
    """At the recipes' shape (1B, 16,384 x 1, bf16 activations) on a planned H100 (fake kernels on
    meta tensors): every kernel call of the pass before the first collective, arguments, strides and
    dtypes included (what Triton's tuning keys and specialisations read), is one that a block of the
    model makes in a training step."""
    with planned_machine(KernelEnvironment.planned_gpu((9, 0))):
        config = model_registry.model_spec(family, "1B", {"n_layers": 1}).model
        meta = torch.device("meta")
        with _Calls() as tuned:
            linear_tuning.run_mixer(
                config.args,
                config.layers[0].mixer.backend,
                batch=1,
                seq_len=16384,
                dtype=torch.bfloat16,
                device=meta,
            )
        with meta:
            model = config.build()
        model.to(torch.bfloat16)
        with _Calls() as step:
            model(torch.zeros(1, 16384, dtype=torch.long, device=meta)).float().sum().backward()
    recurrence = [c for c in tuned.calls if not c[0].startswith("canon_")]
    assert len(recurrence) == 2 and len(tuned.calls) == (2 if family == "mamba2" else 4) * 2
    for call in tuned.calls:
        assert call in step.calls


def test_the_tuning_pass_reports_each_kernel_and_keeps_the_random_state(caplog, monkeypatch):
    """In Triton's interpreter (the GLA kernels' own code on the CPU): one line per kernel as it
    starts tuning, naming how many of fla's configurations it times, with the seconds since the
    first; the pass runs once per shape, waits for no one in one process, and the model's
    initialisation draws the numbers it would have."""
    if not tuning.device_for_kernels().type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from canon_titan.kernels import backends

    backends.prepare_kernels("fla")
    for (
        module_name,
        kernels,
    ) in tuning.NARROWED.items():  # earlier tests of this process may have tuned them
        for name in kernels:
            tuning.autotuner_of(getattr(sys.modules[module_name], name)).cache.clear()
    args = model_registry.model_spec("gla5", "debug", {"kernel_backend": "fla"}).model.args
    state = torch.get_rng_state()
    caplog.set_level("INFO")
    linear_tuning.tune_mixer(args, "fla", batch=1, seq_len=40, tp=2, dtype=torch.float32)
    assert torch.equal(torch.get_rng_state(), state)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel tuning: ")]
    assert (
        "GLA5 mixer on fla, batch 1 x 40, 2 heads, torch.float32: a forward and backward"
        in lines[0]
    )
    assert "tuned in" in lines[-1]
    tuned = {line.split(": ")[1]: line.split(": ")[2] for line in lines[1:-1]}
    assert set(tuned) == set(GLA)
    assert tuned["chunk_gla_fwd_kernel_o"].startswith("2 of 36 configurations (+")
    seconds = [float(line.rsplit("(+", 1)[1].split(" s)")[0]) for line in lines]
    assert seconds == sorted(seconds)
    caplog.clear()
    linear_tuning.tune_mixer(args, "fla", batch=1, seq_len=40, tp=2, dtype=torch.float32)
    assert not caplog.records  # once per shape
    # fla's whole list on a GPU the rules were not measured on (an A100: sm_80), and with
    # CANON_TITAN_FULL_AUTOTUNE=1.
    tuner = tuning.autotuner_of(sys.modules["fla.ops.gla.chunk"].chunk_gla_fwd_kernel_o)
    assert len(tuner.early_config_prune(tuner.configs, {})) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert len(tuner.early_config_prune(tuner.configs, {})) == len(tuner.configs) == 36
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert len(tuner.early_config_prune(tuner.configs, {})) == 2
    monkeypatch.setenv(tuning.FULL_AUTOTUNE_ENV, "1")
    assert len(tuner.early_config_prune(tuner.configs, {})) == 36


def test_the_pretuning_command_refuses_what_it_cannot_tune(capsys):
    """``python -m canon_titan.launch.pretune CONFIG``: one line and exit 2 for a model that is not
    a linear one, and for a run whose recurrence runs on torch."""
    from canon_titan.launch import pretune

    assert pretune.main([str(REPO / "train_configs" / "llama_debug.toml")]) == 2
    assert "[model] name: the kernel tuning is for gla5, gdn2 and mamba2" in capsys.readouterr().err
    gla5 = str(REPO / "train_configs" / "gla5_debug.toml")
    assert pretune.main([gla5, "--model.kernel_backend", "torch"]) == 2
    assert (
        "its recurrence runs on torch here ('torch'): nothing to tune"
        in capsys.readouterr().err.strip()
    )


@pytest.mark.slow
def test_a_rank_slower_to_tune_than_the_collective_timeout_does_not_end_the_run(tmp_path):
    """Two gloo processes, GLA5 debug on fla's kernels (Triton's interpreter), collectives timing
    out after 8 s, rank 1 tuning 20 s longer than rank 0 (tests/slow_tuning_rank.py): rank 0 waits
    for it before the first collective and both train. (Without the wait, rank 0's first collective
    timed out: gloo's "Timed out waiting 8000ms".)"""
    overrides = [
        *COMMON,
        "--training.steps",
        "2",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--model.n_layers",
        "1",
        "--model.kernel_backend",
        "fla",
        "--checkpoint.enable",
        "false",
        "--comm.init_timeout_seconds",
        "8",
        "--comm.train_timeout_seconds",
        "8",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    cmd = torchrun_cmd(2, REPO / "train_configs" / "gla5_debug.toml", overrides)
    cmd[cmd.index("-m", cmd.index("--nproc_per_node=2")) : cmd.index("canon_titan.train") + 1] = [
        str(REPO / "tests" / "slow_tuning_rank.py")
    ]
    started = time.perf_counter()
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=dict(train_env(), SLOW_TUNING_S="20", TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert time.perf_counter() - started > 20
    assert "kernel tuning: every rank done after" in out
    assert "kernel tuning: chunk_gla_fwd_kernel_o: 2 of" in out
    assert "step:  2" in out
