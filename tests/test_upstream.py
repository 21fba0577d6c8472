"""What canon-titan takes from torch, TorchTitan and torchao beyond their public API, pinned: every
name it patches or whose private form it calls (with the parameters its code assumes), every
message its control flow or its log filters key on, held to the installed packages. A release
that renames, re-signs or rewords one fails here by name, instead of a shim that silently stops
applying or a filter that silently lets a line through. ``docs/development.md`` lists the same
names with the upstream limitation each works around; a scan of the package finds every
assignment to an attribute of those packages' objects, which must be one of these.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from conftest import REPO

PATCHED = [
    # (module, name in it, the parameters the patch or call assumes (None: not a function, or any),
    # where, scope) -- CPU (gloo) training: tools/runtime.py, off on an accelerator
    ("torchtitan.tools.utils", "device_type", None, "tools/runtime.py", "cpu"),
    ("torchtitan.tools.utils", "device_module", None, "tools/runtime.py", "cpu"),
    ("torchtitan.tools.utils", "get_peak_flops", ["device_name"], "tools/runtime.py", "cpu"),
    (
        "torchtitan.distributed.fsdp",
        "disable_fsdp_gradient_division",
        ["model"],
        "tools/runtime.py",
        "cpu",
    ),
    (
        "torch.distributed",
        "barrier",
        ["group", "async_op", "device_ids", "timeout"],
        "tools/runtime.py",
        "cpu",
    ),
    ("torchtitan.trainer", "time", None, "tools/runtime.py", "cpu"),
    # -- a torch without the names TorchTitan 0.3.0 calls (feature checks): tools/runtime.py
    (
        "torch.distributed.distributed_c10d",
        "_set_pg_timeout",
        ["timeout", "group"],
        "tools/runtime.py",
        "torch",
    ),
    (
        "torch.distributed.pipelining.schedules",
        "PipelineScheduleSingle.step",
        ["self", "args", "target", "losses", "return_outputs", "loss_kwargs", "kwargs"],
        "tools/runtime.py",
        "torch",
    ),
    (
        "torch.distributed.pipelining.schedules",
        "PipelineScheduleMulti.step",
        ["self", "args", "target", "losses", "return_outputs", "loss_kwargs", "kwargs"],
        "tools/runtime.py",
        "torch",
    ),
    (
        "torch.distributed.pipelining.schedules",
        "PipelineScheduleMulti._step_microbatches",
        ["self", "arg_mbs", "kwarg_mbs", "target_mbs", "losses", "return_outputs", "loss_kwargs"],
        "tools/runtime.py",
        "torch",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage.clear_runtime_states",
        ["self"],
        "tools/runtime.py",
        "torch",
    ),
    # -- every run
    (
        "torch.distributed.elastic.multiprocessing.api",
        "_terminate_process_handler",
        ["signum", "frame"],
        "launch/torchrun.py",
        "launcher",
    ),
    ("torch", "Tensor._make_subclass", None, "models/common/context_parallel.py", "cp"),
    (
        "torch.nn.attention.bias",
        "CausalBias.__init__",
        ["self", "variant", "seq_len_q", "seq_len_kv"],
        "models/common/context_parallel.py",
        "cp",
    ),
    (
        "torch.distributed.checkpoint",
        "FileSystemReader._slice_file",
        ["self", "file", "sinfo"],
        "convert/dcp_io.py",
        "every run",
    ),
    (
        "torch.distributed.pipelining.schedules",
        "_PipelineSchedule._step_microbatches",
        ["self", "arg_mbs", "kwarg_mbs", "target_mbs", "losses", "return_outputs", "loss_kwargs"],
        "components/validation.py",
        "validation",
    ),
    (
        "torch.distributed.pipelining.schedules",
        "_PipelineScheduleRuntime",
        None,
        "components/validation.py",
        "validation",
    ),
    (
        "torch.distributed.pipelining.schedules",
        "_ComputationType.FORWARD",
        None,
        "components/validation.py",
        "validation",
    ),
    (
        "torchtitan.components.checkpointer",
        "CheckpointManager._should_save",
        ["self", "curr_step", "last_step"],
        "components/checkpointer.py, trainer.py",
        "every run",
    ),
    (
        "torch.distributed.checkpoint",
        "DefaultLoadPlanner.set_up_planner",
        ["self", "state_dict", "metadata", "is_coordinator"],
        "components/checkpointer.py",
        "every run",
    ),
    (
        "torch.distributed.distributed_c10d",
        "_get_default_store",
        [],
        "kernels/tuning.py",
        "every run",
    ),
    ("lm_eval.evaluator", "get_git_commit_hash", [], "evaluation/lm.py", "every evaluation"),
    # -- the planner: plan/
    (
        "torch.distributed.tensor._sharding_prop",
        "_propagate_use_strided_shard_flag",
        ["op_strategy", "op_schema"],
        "plan/strided_scan.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage._warmup_forward_vote",
        ["self", "has_backward", "received_acc"],
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage._warmup_backward_result",
        ["self", "received_result"],
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage._recv_meta",
        ["self", "src_stage"],
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage._send_meta",
        ["self", "meta", "dst_stage"],
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage._forward_metadata_inference",
        None,
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage._backward_metadata_inference",
        None,
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining._utils",
        "InferenceMode.needs_dynamic",
        ["meta", "stage_has_backward"],
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining._utils",
        "_derive_grad_metas",
        ["tensor_metas"],
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining._utils",
        "_StageBackwardMeta",
        ["backward_metas"],
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining.schedules",
        "_add_unshard_reshard",
        ["compute_actions", "max_active_stages"],
        "plan/fake_world.py",
        "planner",
    ),
    (
        "torch.distributed.pipelining.schedules",
        "_PipelineScheduleRuntime._assert_unsharded",
        ["self", "stage"],
        "plan/fake_world.py",
        "planner",
    ),
    ("torch", "UntypedStorage.resize_", None, "plan/recorder.py", "planner"),
    (
        "torch.distributed.tensor._sharding_prop",
        "ShardingPropagator._propagate_tensor_meta_non_cached",
        ["self", "op_schema"],
        "plan/recorder.py",
        "planner",
    ),
    (
        "torch.distributed._tools.fake_collectives",
        "CollectiveOp.get_process_group",
        None,
        "plan/recorder.py",
        "planner",
    ),
    (
        "torch.distributed._tools.fake_collectives",
        "CollectiveOp.get_comm_tensor_size",
        None,
        "plan/recorder.py",
        "planner",
    ),
    ("torch.nn", "Module.to_empty", ["self", "device", "recurse"], "plan/fake_world.py", "planner"),
    (
        "torchtitan.protocols.model",
        "BaseModel.init_weights",
        ["self", "kwargs"],
        "plan/fake_world.py",
        "planner",
    ),
    ("torchtitan.tools.utils", "get_local_device", [], "plan/fake_world.py", "planner"),
    # -- fla's GLA with document boundaries: kernels/gla.py
    (
        "fla.ops.common.chunk_h",
        "prepare_chunk_offsets",
        ["cu_seqlens", "chunk_size"],
        "kernels/gla.py",
        "fla",
    ),
    # -- Triton's interpreter (the CUDA kernels on a CPU, tests only): kernels/interpreter.py
    (
        "triton.runtime.autotuner",
        "Autotuner.do_bench",
        None,
        "kernels/interpreter.py",
        "interpreter",
    ),
    ("torch.cuda", "device", None, "kernels/interpreter.py", "interpreter"),
    # -- counting a launch's SASS without a GPU (the kernel cost instrument): the launches recorded,
    # not run (kernels/sass.py), and a process that answers as an H100 would (plan/kernel_counts.py)
    (
        "triton.runtime.jit",
        "KernelInterface.__getitem__",
        ["self", "grid"],
        "kernels/sass.py: record_launches",
        "counting",
    ),
    ("torch.cuda", "device_count", None, "plan/kernel_counts.py: _as_hopper", "counting"),
    ("torch.cuda", "current_device", None, "plan/kernel_counts.py: _as_hopper", "counting"),
    ("torch.cuda", "get_device_name", None, "plan/kernel_counts.py: _as_hopper", "counting"),
    ("torch.cuda", "get_device_capability", None, "plan/kernel_counts.py: _as_hopper", "counting"),
    ("torch.cuda", "get_device_properties", None, "kernels/interpreter.py", "interpreter"),
    (
        "torch._functorch.config",
        "decompose_custom_triton_ops",
        None,
        "kernels/canon.py",
        "interpreter",
    ),
]

MESSAGES = [
    # (module whose source says it, the text canon-titan keys on, where)
    # GradScaler's contract with the fused optimizers: an optimizer's ``found_inf`` attribute skips
    # its update on the device when it holds 1 (the divergence guard's skip, without a host sync).
    (
        "torch.optim.adam",
        'found_inf=getattr(self, "found_inf", None)',
        "components/optimizer.py: a skipped update",
    ),
    ("torch.optim.adamw", "found_inf", "components/optimizer.py: a skipped update"),
    # DCP's load planner keeps the flattened entries it will read in ``state_dict``.
    (
        "torch.distributed.checkpoint.default_planner",
        "self.state_dict = state_dict",
        "components/checkpointer.py: an earlier checkpoint's train state",
    ),
    (
        "triton.runtime.autotuner",
        "self.early_config_prune",
        "kernels/tuning.py: the narrowing of fla's autotuning",
    ),
    # fla's state kernels read the chunk count of documents back from the device; the host knows it.
    (
        "fla.ops.common.chunk_h",
        "split_offsets = prepare_chunk_offsets(cu_seqlens, BS)\n"
        "        N, NS = len(cu_seqlens) - 1, split_offsets[-1].item()",
        "kernels/gla.py: the chunk count of documents",
    ),
    (
        "torchtitan.trainer",
        '"Training completed"',
        "trainer.py: dropped when a preempted run stops early",
    ),
    (
        "torchtitan.trainer",
        '"Sleeping 2 seconds for other ranks to complete"',
        "tools/runtime.py: end-barrier",
    ),
    ("torchtitan.trainer", "Peak FLOPS used for computing MFU", "tools/runtime.py: quiet-cpu-log"),
    (
        "torchtitan.distributed.utils",
        "ENV[",
        "tools/runtime.py: quiet-cpu-log (TORCH_NCCL_ASYNC_ERROR_HANDLING)",
    ),
    (
        "torch.distributed.tensor._random",
        "may not have complete support",
        "tools/runtime.py: quiet-cpu-log",
    ),
    (
        "torch.distributed.elastic.multiprocessing.api",
        '"Sending process %s closing signal %s"',
        "launch/torchrun.py: _PurposefulStops",
    ),
    (
        "torch.distributed.elastic.multiprocessing.api",
        '"failed (exitcode: %s)',
        "launch/torchrun.py: _PurposefulStops",
    ),
    (
        "torch.distributed.elastic.multiprocessing.errors.error_handler",
        '"no error file defined',
        "launch/torchrun.py: _PurposefulStops",
    ),
    ("torchao", 'f"Failed to load {', "tools/startup.py: NOISE"),
    (
        "torch.utils._pytree",
        '"%s is an Enum subclass and is now natively supported by "',
        "tools/startup.py: NOISE",
    ),
    (
        "torch.distributed.tensor._redistribute",
        '"While redistributing from %s to %s',
        "tools/startup.py: NOISE",
    ),
    # a resume's schedulers: TorchTitan's load calls get_lr() outside step(), which torch warns
    (
        "torchtitan.components.optimizer.lr_scheduler",
        "scheduler._last_lr = scheduler.get_lr()",
        "components/lr_schedule.py: quiet_resume",
    ),
    (
        "torch.optim.lr_scheduler",
        '"To get the last learning rate computed by the scheduler, "',
        "components/lr_schedule.py: GET_LR_WARNING",
    ),
    (
        "lm_eval.evaluator",
        'results["git_hash"] = get_git_commit_hash()',
        "evaluation/lm.py: evaluate",
    ),
]

SETTINGS = {"triton.knobs.cache.dir", "triton.knobs.nvidia.dump_ptxas_log"}
"""Attributes of upstream objects that the package assigns as their documented way of being
configured (Triton's knobs), which are no patch."""
ADDED = {"torch.distributed.set_timeout"}
"""Names a shim adds where torch lacks them (TorchTitan 0.3.0 calls ``dist.set_timeout``, which
torch 2.13 has only as ``_set_pg_timeout``, pinned above)."""

UPSTREAM = ("torch", "torchtitan", "torchao", "triton")


def _resolve(module: str, name: str):
    target = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(target, part), (
            f"canon-titan relies on {module}.{name}, and the installed package has no such name"
        )
        target = getattr(target, part)
    return target


@pytest.mark.parametrize(
    "module,name,parameters,where,scope", PATCHED, ids=[f"{p[0]}.{p[1]}" for p in PATCHED]
)
def test_every_patched_or_private_name_is_still_there(module, name, parameters, where, scope):
    target = _resolve(module, name)
    if parameters is not None:
        assert list(inspect.signature(target).parameters) == parameters, (
            f"{module}.{name} now takes {inspect.signature(target)}; {where} assumes {parameters}"
        )


@pytest.mark.parametrize("module,text,where", MESSAGES, ids=[m[1] for m in MESSAGES])
def test_every_message_canon_titan_keys_on_is_still_said(module, text, where):
    source = inspect.getsource(importlib.import_module(module))
    assert text in source, f"{module} no longer says {text!r}, which {where} keys on"


def test_the_shims_guards_hold_on_the_installed_packages():
    """What the guarded shims check of upstream source before they apply, true here: a guard that
    stopped holding would silently leave the shim off."""
    import torchtitan.trainer as tt_trainer
    from torch.distributed.tensor import _sharding_prop

    from canon_titan.tools.runtime import END_OF_TRAINING_SLEEP

    strided = inspect.getsource(_sharding_prop._propagate_use_strided_shard_flag)
    assert set(re.findall(r"op_schema\.(\w+)", strided)) == {"args_spec"}
    train = inspect.getsource(tt_trainer.Trainer.train)
    assert inspect.getsource(tt_trainer).count("time.sleep(") == 1
    assert "time.sleep(" in train.split(END_OF_TRAINING_SLEEP, 1)[1]


def _assigned_upstream_attributes(path: Path) -> set[str]:
    """The dotted upstream names a source file assigns to (``a.b = ...``, ``setattr``,
    ``patch.object``), through the names it imports from those packages and the local names it binds
    to their objects (``cls = stage.PipelineStage``, ``for cls in (schedules.A, schedules.B)``)."""
    tree = ast.parse(path.read_text())
    names: dict[str, list[str]] = {}

    def dotted(node) -> list[str]:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in names:
            return []
        return [".".join([base, *reversed(parts)]) for base in names[node.id]]

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UPSTREAM:
                    names[alias.asname or alias.name.split(".")[0]] = [
                        alias.name if alias.asname else alias.name.split(".")[0]
                    ]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in UPSTREAM
        ):
            for alias in node.names:
                names[alias.asname or alias.name] = [f"{node.module}.{alias.name}"]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Attribute)
            and dotted(node.value)
        ):
            names[node.targets[0].id] = dotted(node.value)
        elif (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and isinstance(node.iter, ast.Tuple)
        ):
            bases = [d for elt in node.iter.elts for d in dotted(elt)]
            if bases:
                names[node.target.id] = bases
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [
                t
                for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
            found.update(d for t in targets if isinstance(t, ast.Attribute) for d in dotted(t))
        elif (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and (
                (isinstance(node.func, ast.Name) and node.func.id == "setattr")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "object")
            )
        ):
            found.update(f"{d}.{node.args[1].value}" for d in dotted(node.args[0]))
    return found


def test_every_upstream_attribute_the_package_assigns_is_pinned():
    """A scan of the package's source: each attribute of a torch, TorchTitan, torchao or Triton
    object that it assigns is a name pinned above (or a documented setting)."""
    pinned = {f"{module}.{name}" for module, name, *_ in PATCHED} | SETTINGS | ADDED
    package = REPO / "canon_titan"
    found = {
        (str(path.relative_to(package)), name)
        for path in package.rglob("*.py")
        for name in _assigned_upstream_attributes(path)
    }
    assert found, "the scan finds nothing: it no longer reads the package"
    unpinned = sorted((where, name) for where, name in found if name not in pinned)
    assert not unpinned, f"assigned and not pinned in tests/test_upstream.py: {unpinned}"


MIRROR_CALLEES = [
    # (module, name, the parameters components/queued_step.py passes or relies on), which TorchTitan
    # 0.3.0's Trainer.train_step and pp_forward_backward_step call as the mirror does. The pipeline
    # schedule's ``step`` is pinned in PATCHED.
    (
        "torchtitan.trainer",
        "Trainer.forward_backward_step",
        ["self", "input_dict", "labels", "global_valid_tokens"],
    ),
    ("torchtitan.trainer", "Trainer.post_dataloading_process", ["self", "input_dict", "labels"]),
    ("torchtitan.distributed.utils", "dist_sum_tensor", ["x", "mesh", "extra_pg"]),
    ("torchtitan.distributed.utils", "dist_sum", ["x", "mesh", "extra_pg"]),
    ("torchtitan.distributed.utils", "dist_max", ["x", "mesh", "extra_pg"]),
    (
        "torchtitan.distributed.utils",
        "clip_grad_norm_",
        [
            "parameters",
            "max_norm",
            "norm_type",
            "error_if_nonfinite",
            "foreach",
            "pp_mesh",
            "ep_enabled",
        ],
    ),
    (
        "torchtitan.components.metrics",
        "MetricsProcessor.log",
        ["self", "step", "global_avg_loss", "global_max_loss", "grad_norm", "extra_metrics"],
    ),
    ("torchtitan.components.metrics", "MetricsProcessor.should_log", ["self", "step"]),
    ("torchtitan.components.optimizer", "OptimizersContainer.zero_grad", ["self", "set_to_none"]),
    ("torchtitan.components.optimizer", "LRSchedulersContainer.get_metrics", ["self"]),
    ("torchtitan.components.optimizer", "LRSchedulersContainer.step", ["self"]),
    ("torchtitan.components.checkpointer", "CheckpointManager.maybe_wait_for_staging", ["self"]),
    (
        "torchtitan.observability.structured_logger",
        "log_trace_span",
        ["event_type", "description", "stacklevel"],
    ),
    ("torchtitan.observability.structured_logger", "log_trace_scalar", ["scalars", "stacklevel"]),
    ("torchtitan.distributed", "ParallelDims.get_mesh", ["self", "dims"]),
    (
        "torchtitan.distributed",
        "ParallelDims.get_optional_mesh",
        ["self", "dims", "include_singleton_axes"],
    ),
]


@pytest.mark.parametrize(
    "module,name,parameters", MIRROR_CALLEES, ids=[f"{c[0]}.{c[1]}" for c in MIRROR_CALLEES]
)
def test_what_the_queued_step_calls_takes_what_it_passes(module, name, parameters):
    """A callee of the mirrored methods that changes its parameters fails here by name, even where
    the mirrored methods' own source (hashed below) did not change."""
    target = _resolve(module, name)
    assert list(inspect.signature(target).parameters) == parameters, (
        f"{module}.{name} now takes {inspect.signature(target)}; components/queued_step.py passes "
        f"{parameters}"
    )


def test_the_queued_step_calls_only_pinned_torchtitan_helpers():
    """Every TorchTitan module function the queued step calls (``dist_utils.*``, ``sl.*``) is one
    pinned in MIRROR_CALLEES, so that a new call cannot skip the pin."""
    from canon_titan.components import queued_step

    tree = ast.parse(inspect.getsource(queued_step))
    modules = {
        "dist_utils": "torchtitan.distributed.utils",
        "sl": "torchtitan.observability.structured_logger",
    }
    called = {
        (modules[node.func.value.id], node.func.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in modules
    }
    assert called, "the scan finds no call: it no longer reads the queued step"
    assert called <= {(module, name) for module, name, _ in MIRROR_CALLEES}, called


def test_the_methods_the_queued_step_mirrors_are_the_ones_it_was_written_from():
    """``components/queued_step.py`` does the work of TorchTitan methods pinned there by a hash of
    their source: a release that changes one fails here, to be compared with what the queued step
    does (its callees are pinned above; ``docs/development.md`` names the upstream change that ends
    the mirror)."""
    import hashlib

    from canon_titan.components.queued_step import MIRRORED

    changed = sorted(
        name
        for name, digest in MIRRORED.items()
        if hashlib.sha256(
            inspect.getsource(_resolve("torchtitan.trainer", name)).encode()
        ).hexdigest()[:16]
        != digest
    )
    assert not changed, (
        f"TorchTitan's {changed} changed since canon_titan/components/queued_step.py mirrored "
        "them: compare, then pin the new source there"
    )


def test_the_development_page_lists_every_patch():
    """docs/development.md names each patched or privately used name with why (its section on
    upstream patches)."""
    page = (REPO / "docs" / "development.md").read_text()
    missing = [f"{module}.{name}" for module, name, *_ in PATCHED if f"`{name}`" not in page]
    assert not missing, f"docs/development.md does not name {missing}"
