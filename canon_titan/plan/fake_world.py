"""One rank of a training run, built and stepped in this process on fake tensors and a fake
process group: canon-titan's real Trainer (TorchTitan's model build, the family's parallelize
function, float8 conversion, the optimizer, the step with its gradient accumulation), only with
no memory behind its tensors and no peers behind its collectives.

What differs from a real run, and why:
- The model is built on the meta device, parallelized and sharded as in training; it is then
  materialised as fake tensors instead of memory (``to_empty`` and the weight initialisation run
  under the fake mode).
- Batches have the run's shape but no data (the data files and tokenizer belong to the cluster).
- Values a step reads back from tensors (the loss, the token count, rejection sampling in
  truncated-normal initialisation) are fake: 1, or False for a condition.
- ``torch.compile`` is off: compiled code cannot run on fake tensors. The plan accounts for
  compile from the eager op sequence instead (``estimate``).
- Optimizer state exists from the start, as in every step after the first.
- At most two gradient-accumulation groups run; the others repeat the second exactly.
- Pipeline stages learn their neighbours' tensor shapes without them: the stages of a plan are
  built in order, each passing on what it would send (a looped schedule's later stage on an early
  rank takes the shapes of an earlier boundary: a decoder passes the same hidden states across
  each), and a stage takes its output gradients' shapes from its outputs (as PyTorch does when
  the shapes are given). That exchange, done once before the first step, is not recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import tempfile
from dataclasses import dataclass, field
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from canon_titan.kernels.documents import one_document_a_row
from canon_titan.plan.recorder import StepRecorder, StepTrace

_SCALAR = torch.ops.aten._local_scalar_dense.default
_NONZERO = torch.ops.aten.is_nonzero.default


class FakeScalars(TorchDispatchMode):
    """Answers the reads of a value from a fake tensor (``.item()``, ``bool(t)``): 1, or False.
    A real tensor gives its value."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _NONZERO or func is _SCALAR:
            if not isinstance(args[0], FakeTensor):
                if type(args[0]) is not torch.Tensor:
                    return NotImplemented  # a DTensor: asked again of its local tensor
                with unset_fake_temporarily():
                    return func(*args, **(kwargs or {}))
            if func is _NONZERO:
                return False
            dtype = args[0].dtype
            return False if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        return func(*args, **(kwargs or {}))


@dataclass
class ShapeOnlyBatches:
    """Batches of the run's shape with no data: token ids, labels and, where the run's loader
    gives them, positions."""

    batch_size: int
    seq_len: int
    positions: bool

    def __iter__(self):
        while True:
            inputs = {"input": torch.zeros(self.batch_size, self.seq_len, dtype=torch.long)}
            if self.positions:  # one document a row
                inputs["positions"] = torch.arange(self.seq_len).expand(self.batch_size, -1)
                inputs.update(one_document_a_row(self.batch_size, self.seq_len))
            yield inputs, torch.zeros(self.batch_size, self.seq_len, dtype=torch.long)


@dataclass
class ShapeOnlyData:
    """Stands in for the dataloader and tokenizer configs: ``build`` as TorchTitan calls them."""

    positions: bool

    def build(self, **kwargs):
        if "local_batch_size" not in kwargs:  # the tokenizer
            return None
        return ShapeOnlyBatches(kwargs["local_batch_size"], kwargs["seq_len"], self.positions)


@dataclass
class RankStep:
    """What one rank's step did, with what the trace needs to be read."""

    rank: int
    trace: StepTrace
    categories: dict[int, str]
    """Storage id -> parameters, gradients, optimizer state or buffers."""
    state_bytes: dict[str, int]
    """Bytes of this rank's parameters, gradients and optimizer state (their local tensors)."""
    group_names: dict[tuple[int, ...], str]
    """Process groups (global ranks) -> the parallelism they belong to."""
    accumulation: int
    """The run's gradient-accumulation groups per step."""
    groups_run: int
    """How many of them ran (the rest repeat the last)."""
    tokens_per_group: int
    """Tokens this rank's data-parallel group member feeds per accumulation group."""
    parallel: dict[str, int] = field(default_factory=dict)
    pp_stage: int = 0
    pp_microbatches: int = 1
    param_count: int = 0
    """Parameters of this rank's model parts (the whole model without PP), unsharded."""
    stages_per_rank: int = 1
    flops_per_token: int = 0
    """The trainer's own (analytic) FLOPs per token, as its MFU uses."""
    compiled_ops: frozenset[int] | None = None
    """Indices of the ops that ran inside the model's compiled blocks (``CompiledBlocks``); None
    where that was not recorded."""
    compiled_graphs: dict[int, int] | None = None
    """For each op in ``compiled_ops``, the compiled graph it ran in: one per call of a block (or
    of the loss) for its forward, and the same for that call's backward (its phase tells them
    apart). Inductor fuses and inlines only inside one graph."""


_GROUP_NAMES = ("tp", "cp", "fsdp", "dp_shard", "dp_replicate", "pp", "batch", "loss", "dp_cp")


def _group_names(parallel_dims) -> dict[tuple[int, ...], str]:
    names = {}
    for name in _GROUP_NAMES:
        try:
            mesh = parallel_dims.get_optional_mesh(name)
        except (KeyError, ValueError, RuntimeError, AttributeError):
            continue
        if mesh is None or mesh.ndim != 1:
            continue
        ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
        names.setdefault(ranks, name)
    names.setdefault(tuple(range(parallel_dims.world_size)), "world")
    return names


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _optimizer_tensors(optimizers) -> list[torch.Tensor]:
    tensors = []
    for optimizer in getattr(optimizers, "optimizers", [optimizers]):
        for state in optimizer.state.values():
            tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _bytes(tensors) -> int:
    """Bytes of distinct storages."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if id(st) not in seen:
            seen.add(id(st))
            total += st.nbytes()
    return total


def warm_optimizer(trainer) -> None:
    """Give every parameter a zero gradient and step the optimizer once (learning rate 0), so
    its state exists as in every step after the first; then drop the gradients."""
    params = [p for m in trainer.model_parts for p in m.parameters() if p.requires_grad]
    for optimizer in trainer.optimizers.optimizers:
        for group in optimizer.param_groups:
            group["_lr"], group["lr"] = group["lr"], 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    trainer.optimizers.step()
    trainer.optimizers.zero_grad(set_to_none=True)
    for optimizer in trainer.optimizers.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group.pop("_lr")


@dataclass
class _GroupMarks:
    """What ``record_step`` marks in its recorder around each gradient-accumulation group."""

    recorder: StepRecorder
    groups: int
    categories: dict
    grads: list
    done: int = 0


class RecordedGroups:
    """A ``CanonTrainer`` mixin for ``record_step``: while a step is recorded, each
    gradient-accumulation group is marked in the recorder, and after the last one the gradients
    are registered and the optimizer's phase begins (clipping, the optimizer step)."""

    group_marks: _GroupMarks | None = None

    def forward_backward_step(self, **kwargs):
        marks = self.group_marks
        if marks is None:
            return super().forward_backward_step(**kwargs)
        marks.recorder.mark(f"group {marks.done}")
        loss = super().forward_backward_step(**kwargs)
        marks.done += 1
        if marks.done == marks.groups:
            marks.grads.extend(
                _local(p.grad)
                for m in self.model_parts
                for p in m.parameters()
                if p.grad is not None
            )
            registered = marks.recorder.register(marks.grads)
            marks.categories.update({sid: "gradients" for sid in registered})
            marks.recorder.mark("optimizer")
            marks.recorder.phase_override = "optimizer"
        return loss


def record_step(
    trainer: RecordedGroups, recorder: StepRecorder, *, max_groups: int = 2, modes=()
) -> RankStep:
    """Run one training step of a built trainer (a ``RecordedGroups`` one) under ``recorder`` (and
    ``modes`` around it): the optimizer state already there, at most ``max_groups``
    gradient-accumulation groups."""
    accumulation = trainer.gradient_accumulation_steps
    groups = min(accumulation, max_groups)
    trainer.gradient_accumulation_steps = groups
    params = [_local(p) for m in trainer.model_parts for p in m.parameters()]
    buffers = [b for m in trainer.model_parts for b in m.buffers()]
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        warm_optimizer(trainer)
        categories = {sid: "buffers" for sid in recorder.register(buffers)}
        categories.update({sid: "parameters" for sid in recorder.register(params)})
        optimizer_state = _optimizer_tensors(trainer.optimizers)
        categories.update({sid: "optimizer state" for sid in recorder.register(optimizer_state)})
        grads: list[torch.Tensor] = []
        trainer.group_marks = _GroupMarks(recorder, groups, categories, grads)
        trainer.step = 2  # neither the first step nor (with the log frequency raised) a logging one
        try:
            with recorder:
                trainer.train_step(iter(trainer.dataloader))
        finally:
            trainer.group_marks = None
            trainer.gradient_accumulation_steps = accumulation
            recorder.phase_override = None
    dims = trainer.parallel_dims
    tokens = trainer.config.training.local_batch_size * trainer.config.training.seq_len
    return RankStep(
        rank=dist.get_rank() if dist.is_initialized() else 0,
        trace=recorder.trace,
        categories=categories,
        state_bytes={
            "parameters": _bytes(params),
            "gradients": _bytes(grads),
            "optimizer state": _bytes(optimizer_state),
        },
        group_names=_group_names(dims),
        accumulation=accumulation,
        groups_run=groups,
        tokens_per_group=tokens,
        parallel={
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "cp": dims.cp,
            "tp": dims.tp,
            "pp": dims.pp,
        },
        pp_stage=dims.get_mesh("pp").get_local_rank() if dims.pp_enabled else 0,
        pp_microbatches=getattr(trainer, "num_pipeline_parallel_microbatches", 1),
        param_count=sum(p.numel() for m in trainer.model_parts for p in m.parameters()),
        stages_per_rank=len(trainer.model_parts),
        flops_per_token=trainer.metrics_processor.num_flops_per_token,
    )


def for_fake_world(config, *, positions: bool, dump_folder: str) -> None:
    """Adjust a built ``Trainer.Config`` to run as one fake rank: no files written (no checkpoints,
    metrics, run_config.toml or evaluation), no compile, no logging steps, shape-only batches."""
    config.metrics.enable_tensorboard = False
    config.metrics.enable_wandb = False
    config.metrics.log_freq = 10**9
    config.metrics.last_step = 0
    config.checkpoint.enable = False
    config.compile = dataclasses.replace(config.compile, enable=False)
    config.evaluation = None
    config.run_toml = ""
    config.dump_folder = dump_folder
    config.dataloader = ShapeOnlyData(positions)
    config.tokenizer = ShapeOnlyData(positions)


PIPELINE_UNSHARD = ("stage", "layer")
"""When a looped pipeline schedule gathers a stage's FSDP-sharded parameters. ``stage``: as torch
runs it from 2.10 (pinned here: 2.13), where ``ScheduleInterleaved1F1B`` (``ScheduleLoopedBFS``
and the zero-bubble schedules too) runs on ``_PipelineScheduleRuntime``: its lowering
(``_add_unshard_reshard``) puts an UNSHARD action before a stage's first compute, which issues the
all-gathers of every FSDP module of the stage at once and waits for them all before the first
one runs, so every block's all-gather buffer is alive together. ``layer``: as torch 2.9 and
before ran ``ScheduleInterleaved1F1B`` (a ``PipelineScheduleMulti``, no UNSHARD action; read in
the 2.6.0 to 2.10.0 wheels): each block gathered by its own FSDP pre-forward hook when it
runs. Single-stage schedules (1F1B, GPipe) gather block by block in both."""


@contextlib.contextmanager
def layer_by_layer_unshard():
    """Looped pipeline schedules built and run inside gather block by block, as torch's
    ``PipelineScheduleMulti`` did before 2.10 (``PIPELINE_UNSHARD``'s ``layer``): the lowering adds
    no UNSHARD or RESHARD actions and the runtime leaves the gathering to FSDP's hooks."""
    from torch.distributed.pipelining import schedules

    def compute_only(actions, max_active_stages=3):
        return [action for action in actions if action is not None]

    with (
        patch.object(schedules, "_add_unshard_reshard", compute_only),
        patch.object(
            schedules._PipelineScheduleRuntime, "_assert_unsharded", lambda self, stage: None
        ),
    ):
        yield


@contextlib.contextmanager
def pipeline_without_peers(sent: dict, recorder: StepRecorder):
    """Pipeline stages on a fake process group: their start-up exchange of shapes (a vote on how to
    learn them, then the shapes) is answered in this process. ``sent`` carries what earlier
    stages sent to later ones."""
    from torch.distributed.pipelining import stage as pipeline_stage

    try:
        from torch.distributed.pipelining._utils import (
            InferenceMode,
            _derive_grad_metas,
            _StageBackwardMeta,
        )
    except ImportError as e:  # torch 2.11 (the offline GPU kit's) has another stage start-up
        raise RuntimeError(
            "planning pipeline parallelism needs torch >= 2.13, whose pipeline stages "
            "this planner "
            f"answers (this torch: {torch.__version__}: {e})"
        ) from None

    cls = pipeline_stage.PipelineStage
    names = (
        "_warmup_forward_vote",
        "_warmup_backward_result",
        "_recv_meta",
        "_send_meta",
        "_forward_metadata_inference",
        "_backward_metadata_inference",
    )
    saved = {name: getattr(cls, name) for name in names}

    def vote(self, has_backward, received_acc=None):
        with unset_fake_temporarily():
            self._plan_vote = torch.tensor(
                [0 if InferenceMode.needs_dynamic(self._user_meta, has_backward) else 1],
                dtype=torch.int32,
            )
        return self._plan_vote

    def result(self, received_result=None):
        return received_result if received_result is not None else self._plan_vote

    def send_meta(self, meta, dst_stage):
        sent[(self.stage_index, dst_stage)] = meta

    def recv_meta(self, src_stage):
        if src_stage > self.stage_index:  # output gradients: the outputs' shapes
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))
        if (src_stage, self.stage_index) in sent:
            return sent[(src_stage, self.stage_index)]
        # A looped schedule's later stage on an early rank: its source is planned after it. Every
        # boundary of a decoder carries the same hidden states, so an earlier boundary's shapes do.
        if not sent:
            raise RuntimeError(
                f"stage {self.stage_index} takes its input from stage {src_stage}, and no stage "
                "boundary has been planned before it"
            )
        return sent[min(sent)]

    def unrecorded(method):
        def run(self, *args, **kwargs):
            with recorder.paused():
                return method(self, *args, **kwargs)

        return run

    cls._warmup_forward_vote, cls._warmup_backward_result = vote, result
    cls._recv_meta, cls._send_meta = recv_meta, send_meta
    cls._forward_metadata_inference = unrecorded(saved["_forward_metadata_inference"])
    cls._backward_metadata_inference = unrecorded(saved["_backward_metadata_inference"])
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(cls, name, method)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    excepthook = sys.excepthook  # init_process_group wraps it to prefix "[rankN]:" (once per plan)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        # DTensor caches each op's output sharding, meshes included, by a key in which a mesh
        # equals any mesh of the same shape and ranks. The next fake world (another pipeline
        # stage's rank, another plan) builds equal meshes on other process groups: a cached output
        # would carry this world's mesh, whose groups no longer exist.
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


@contextlib.contextmanager
def materialized_as_fake(fake_mode: FakeTensorMode):
    """While a trainer is built: the meta model's ``to_empty`` and weight initialisation give fake
    tensors (the rest of the build, meshes included, runs on real and meta tensors as in training),
    on the device fake tensors use."""
    from torchtitan.protocols.model import BaseModel

    to_empty, init_weights = torch.nn.Module.to_empty, BaseModel.init_weights

    def fake_to_empty(self, *, device, recurse=True):
        with fake_mode, FakeScalars():
            return to_empty(self, device=device, recurse=recurse)

    def fake_init_weights(self, **kwargs):
        with fake_mode, FakeScalars():
            return init_weights(self, **kwargs)

    import torchtitan.tools.utils as tt_utils

    local_device = tt_utils.get_local_device
    torch.nn.Module.to_empty, BaseModel.init_weights = fake_to_empty, fake_init_weights
    # Fake tensors live on "cpu", which is not the "cpu:0" the trainer would ask for.
    tt_utils.get_local_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.nn.Module.to_empty, BaseModel.init_weights = to_empty, init_weights
        tt_utils.get_local_device = local_device


def fake_rank_step(
    config,
    *,
    rank: int,
    world_size: int,
    positions: bool,
    fp8_linears: bool = False,
    pipeline_sent: dict | None = None,
    compiled_blocks: bool = False,
    compiled_loss: bool = False,
    pipeline_unshard: str = "stage",
) -> RankStep:
    """Build ``config`` (a ``CanonTrainer.Config`` from ``build_trainer_config``) as rank ``rank``
    of
    ``world_size`` on fake tensors and record one step. Under pipeline parallelism the stages
    before this rank's must have been stepped first with the same ``pipeline_sent``; a looped
    schedule gathers a stage's parameters as ``pipeline_unshard`` says (``PIPELINE_UNSHARD``)."""
    if pipeline_unshard not in PIPELINE_UNSHARD:
        raise ValueError(
            f"pipeline_unshard {pipeline_unshard!r}: expected one of {', '.join(PIPELINE_UNSHARD)}"
        )
    from torchtitan.distributed import ParallelDims

    from canon_titan.plan.strided_scan import strided_shard_scan_once_per_op
    from canon_titan.tools import runtime
    from canon_titan.trainer import CanonTrainer

    runtime.apply(cpu=True)
    strided_shard_scan_once_per_op()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    class FakeRankTrainer(RecordedGroups, CanonTrainer):
        # the planning process keeps its own signal handling (a search plans hundreds of ranks
        # in one process, and must stop on SIGTERM)
        takes_stop_signals = False

        def init_distributed(self):
            return ParallelDims.from_config(self.config.parallelism, world_size)

    with (
        tempfile.TemporaryDirectory(prefix="canon-titan-plan-") as dump_folder,
        patch.dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size)),
        fake_process_group(rank, world_size),
        layer_by_layer_unshard() if pipeline_unshard == "layer" else contextlib.nullcontext(),
    ):
        for_fake_world(config, positions=positions, dump_folder=dump_folder)
        with materialized_as_fake(fake_mode):
            trainer = FakeRankTrainer(config)
        recorder = StepRecorder()
        if fp8_linears:
            _mark_fp8_linears(trainer, recorder)
        compiled = compiled_blocks or compiled_loss
        blocks = (
            CompiledBlocks(trainer, recorder, blocks=compiled_blocks, loss=compiled_loss)
            if compiled
            else contextlib.nullcontext()
        )
        # Only pipeline stages exchange shapes at start-up (and only torch >= 2.13's are answered
        # here).
        peers = (
            pipeline_without_peers({} if pipeline_sent is None else pipeline_sent, recorder)
            if config.parallelism.pipeline_parallel_degree > 1
            else contextlib.nullcontext()
        )
        modes = (fake_mode, FakeScalars(), peers, blocks)
        step = record_step(trainer, recorder, modes=modes)
        if compiled:
            # the steps the recorder adds after an op (a float8 GEMM's rescale) run where it runs
            graphs = blocks.graph_of
            step.compiled_graphs = {
                **graphs,
                **{
                    i: graphs[op.after] for i, op in enumerate(step.trace.ops) if op.after in graphs
                },
            }
            step.compiled_ops = frozenset(step.compiled_graphs)
        trainer.close()
        return step


class CompiledBlocks(TorchDispatchMode):
    """Which recorded ops a compiled step runs inside its compiled code: TorchTitan compiles each
    block of ``model.layers`` (``apply_compile``; ``blocks``) and, with ``loss`` in
    ``[compile] components``, the loss function (``BaseLoss.fn``; ``loss``); not the embedding, the
    final norm, the output projection or the optimizer, and Dynamo skips FSDP's hooks (its
    all-gather copy-in, copy-out and reduce-scatter staging stay eager). Forward: the ops between
    the block's own forward hooks (registered inside FSDP's), or inside the loss function.
    Backward: the ops run while autograd executes a node that the block's (or the loss's) forward
    created (activation-checkpoint recomputation included)."""

    def __init__(self, trainer, recorder, *, blocks: bool = True, loss: bool = False):
        super().__init__()
        self.recorder = recorder
        self.graph_of: dict[int, int] = {}
        """Op index -> the compiled graph (one per block or loss call) it ran in."""
        self._calls: list[int] = []
        self._ids = itertools.count()
        self._nodes: dict = {}
        self._handles = []
        self._loss = None
        for part in trainer.model_parts if blocks else ():
            layers = getattr(part, "layers", None)
            for block in (
                layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers or ()
            ):
                self._handles.append(block.register_forward_pre_hook(self._enter))
                self._handles.append(block.register_forward_hook(self._exit, prepend=True))
        if loss and callable(getattr(trainer.loss_fn, "fn", None)):
            self._loss = trainer.loss_fn
            inner = self._loss.fn

            def compiled_loss(*args, **kwargs):
                self._enter(None, args)
                output = inner(*args, **kwargs)
                self._exit(None, args, output)
                return output

            self._loss.fn = compiled_loss
            self._loss_inner = inner

    def _enter(self, module, args):
        self._calls.append(next(self._ids))

    def _exit(self, module, args, output):
        call = self._calls.pop()
        out = output[0] if isinstance(output, tuple) else output
        stop = {a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
        todo = [out.grad_fn] if isinstance(out, torch.Tensor) and out.grad_fn is not None else []
        while todo:
            node = todo.pop()
            if node is None or node in stop or node in self._nodes:
                continue
            self._nodes[node] = call
            todo.extend(n for n, _ in node.next_functions)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch._C._current_graph_task_id() == -1:
            call = self._calls[-1] if self._calls else None
        else:
            call = self._nodes.get(torch._C._current_autograd_node())
        if call is not None and not str(func).startswith("fsdp."):
            self.graph_of[len(self.recorder.trace.ops)] = call
        return func(*args, **(kwargs or {}))

    def __exit__(self, *args):
        for handle in self._handles:
            handle.remove()
        if self._loss is not None:
            self._loss.fn = self._loss_inner
        self._nodes.clear()
        return super().__exit__(*args)


def _mark_fp8_linears(trainer, recorder: StepRecorder) -> None:
    """The matmuls inside torchao's Float8Linear modules run in float8 on the GPU (here
    emulated)."""
    from torchao.float8.float8_linear import Float8Linear

    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, Float8Linear):
                module.register_forward_pre_hook(lambda *_: recorder.enter_fp8_linear())
                module.register_forward_hook(lambda *_: recorder.exit_fp8_linear())
