"""Held-out validation during training (TOML ``[validation]``): every ``every`` steps and at the
last step, the mean token loss of the current weights over the same held-out windows, and its
perplexity, in the log, TensorBoard and wandb (``validation/loss``, ``validation/perplexity``).

TorchTitan's Trainer builds its ``Trainer.Config.validator`` and calls it after a step's checkpoint
save; ``HeldOutValidator`` is TorchTitan's ``Validator`` with what it lacks for canon-titan's runs:
the project's loaders (rewound, so that every validation reads the same windows,
``data/held_out.py``), the plain cross-entropy (a run's z-loss off), context parallelism's shards
with their documents, and under pipeline parallelism the losses of whichever ranks hold the last
stage (rank 0's under the V schedules). The loss sum and its token count stay on the device and are
summed over every rank in one all-reduce at the end: a validation makes one host read, the training
steps none.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import BaseValidator, Validator
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from canon_titan.components.metrics import PERPLEXITY_TAG, VALIDATION_TAG
from canon_titan.data.packed import PackedTextDataLoader
from canon_titan.data.synthetic import SyntheticDataLoader
from canon_titan.models.common.context_parallel import context_parallel_inputs
from canon_titan.tools.host_memory import to_device

_FORWARD_ACTIONS = {
    schedules._ComputationType.FORWARD,
    schedules._ComputationType.SEND_F,
    schedules._ComputationType.RECV_F,
    schedules._ComputationType.UNSHARD,
    schedules._ComputationType.RESHARD,
}


def _forward_actions(order: dict) -> dict:
    return {
        rank: [
            part
            for action in actions
            for part in (action.sub_actions or (action,))
            if part.computation_type in _FORWARD_ACTIONS
        ]
        for rank, actions in order.items()
    }


def pipeline_forward(
    schedule, arg_mbs, kwarg_mbs, target_mbs, losses: list | None, loss_kwargs: dict
) -> None:
    """Every microbatch forward through the training schedule's stages, the last stage's losses in
    ``losses``, and no backward: the stages' ``has_backward`` is off for it. (torch's ``eval`` turns
    the schedule's own off instead, and then sets up the stages' receive buffers and shapes again
    for it, and for training at the next step, each time with blocking copies and reads on the
    host.) A schedule that runs from a list of actions (the interleaved, zero-bubble and V
    schedules) runs its forward actions and their communication only: the others would run as
    no-ops, and under the V schedules a rank's hand-off of a backward input between its two stages
    fails without a backward."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    had_backward = [stage.has_backward for stage in stages]
    runs_actions = isinstance(schedule, schedules._PipelineScheduleRuntime)
    order = schedule.pipeline_order_with_comms if runs_actions else None
    for stage in stages:
        stage.has_backward = False
        stage.clear_runtime_states()
    if runs_actions:
        schedule.pipeline_order_with_comms = _forward_actions(order)
    try:
        schedule._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs=False, loss_kwargs=loss_kwargs
        )
    finally:
        if runs_actions:
            schedule.pipeline_order_with_comms = order
        for stage, has_backward in zip(stages, had_backward):
            stage.has_backward = has_backward


class HeldOutBatches:
    """A validation's batches on the host, the same ones each time it is iterated: the held-out
    loader is built once and put back at its first window by loading the state it was built with
    (the packed and synthetic loaders), or built again (the streamed loader, whose readers start at
    its first read)."""

    REWOUND_BY_STATE = (PackedTextDataLoader, SyntheticDataLoader)

    def __init__(self, loader_config, steps: int, **loader_kwargs):
        self.loader_config, self.steps, self.loader_kwargs = loader_config, steps, loader_kwargs
        # Built now: held-out data too small for one batch stops the run before it trains.
        self._loader = loader_config.build(**loader_kwargs)
        self._start_state, self._read = self._loader.state_dict(), False

    def _rewound(self):
        if not self._read:
            self._read = True
        elif isinstance(self._loader, self.REWOUND_BY_STATE):
            level = logger.level
            logger.setLevel(logging.WARNING)  # not its "resumes at" line: that is a checkpoint's
            try:
                self._loader.load_state_dict(self._start_state)
            finally:
                logger.setLevel(level)
        else:
            self._loader = self.loader_config.build(**self.loader_kwargs)
        return self._loader

    def __iter__(self):
        """``steps`` batches (-1: until a finite loader ends, at one global batch on every rank)."""
        loader = iter(self._rewound())
        for _ in range(self.steps) if self.steps != -1 else itertools.count():
            try:
                yield next(loader)
            except StopIteration:
                return


class HeldOutValidator(Validator):
    """TorchTitan's validator on the run's held-out data (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        tokens: int = 0
        """Tokens a validation reads at least, instead of ``steps`` (whole batches); 0: steps."""
        last_step: int = 0
        """The run's last step, validated too."""

    def __init__(
        self,
        config: Config,
        *,
        parallelism,
        dp_world_size: int,
        dp_rank: int,
        tokenizer,
        parallel_dims,
        loss_fn,
        validation_context,
        metrics_processor,
        seq_len: int,
        local_batch_size: int,
        pp_schedule=None,
        pp_has_first_stage: bool | None = None,
        pp_has_last_stage: bool | None = None,
        **kwargs,
    ):
        # Not Validator.__init__: it sets its loader config's ``infinite``, a key of TorchTitan's
        # text loader that the synthetic and streamed loaders do not have.
        BaseValidator.__init__(self, config=config)
        self.parallelism, self.parallel_dims = parallelism, parallel_dims
        self.loss_fn, self.validation_context = loss_fn, validation_context
        self.metrics_processor = metrics_processor
        self.pp_schedule, self.pp_has_first_stage = pp_schedule, pp_has_first_stage
        self.pp_has_last_stage = pp_has_last_stage if parallel_dims.pp_enabled else True
        per_batch = local_batch_size * dp_world_size * seq_len
        self.batches = HeldOutBatches(
            config.dataloader,
            math.ceil(config.tokens / per_batch) if config.tokens else config.steps,
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
        )
        self.device = utils.get_local_device()
        steps = self.batches.steps
        amount = f"{steps} batches" if steps != -1 else "every window"
        logger.info(
            f"Validation every {config.freq} steps and at step {config.last_step}: {amount} "
            f"of the held-out data, {local_batch_size} x {dp_world_size} sequences a batch"
        )
        self._since: tuple[float, int] | None = None
        """When, and after which step, the training the next validation's log line compares with
        began."""

    def should_validate(self, step: int) -> bool:
        if self._since is None:  # the first step this process trained has just ended
            self._since = (time.perf_counter(), step)
        return step % self.config.freq == 0 or step == self.config.last_step

    def post_dataloading_process(self, input_dict, labels, model_parts):
        """Under context parallelism this rank's share of each sequence with the ``ContextShards``
        the attention and Canon layers take (the trainer's own split); TorchTitan's path
        otherwise."""
        if not self.parallel_dims.cp_enabled:
            return super().post_dataloading_process(input_dict, labels, model_parts)
        return context_parallel_inputs(
            input_dict,
            labels,
            self.parallel_dims.get_mesh("cp"),
            self.parallelism.context_parallel_load_balancer,
        )

    @torch.no_grad()
    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        # The step's queued work done first: the time below is the validation's.
        utils.device_module.synchronize()
        start = time.perf_counter()
        for model in model_parts:
            model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # this rank's loss, tokens
        for input_dict, labels in self.batches:
            *values, labels = to_device([*input_dict.values(), labels], self.device)
            input_dict = dict(zip(input_dict, values))
            if self.parallel_dims.pp_enabled:
                loss, tokens = self._pipeline_loss(input_dict, labels, model_parts)
            else:
                inputs, labels, extra = self.post_dataloading_process(
                    input_dict, labels, model_parts
                )
                with self.validation_context():
                    loss, _ = self.loss_fn(model_parts[0](inputs, **extra), labels, z_loss=False)
                tokens = (labels != IGNORE_INDEX).sum()
            if self.pp_has_last_stage:
                sums += torch.stack([loss.double(), tokens.double()])
        for model in model_parts:
            model.train()
        if dist.is_initialized():
            dist.all_reduce(sums)
        # Ranks of one tensor-parallel group hold the same loss and labels: both sums count them tp
        # times.
        loss_sum, tokens = sums.tolist()
        self._report(
            step,
            loss_sum / tokens,
            round(tokens / self.parallel_dims.tp),
            time.perf_counter() - start,
        )

    def _pipeline_loss(self, input_dict, labels, model_parts):
        """The batch's loss sum and token count on the last stage's ranks (None elsewhere), its rows
        in the schedule's microbatches."""
        rows = self.parallelism.pipeline_parallel_microbatch_size
        args, kwargs, targets = [], [], [] if self.pp_has_last_stage else None
        for first in range(0, labels.shape[0], rows):
            inputs, mb_labels, extra = self.post_dataloading_process(
                {key: value[first : first + rows] for key, value in input_dict.items()},
                labels[first : first + rows],
                model_parts,
            )
            if self.pp_has_first_stage:
                args.append((inputs,))
            kwargs.append(extra)
            if targets is not None:
                targets.append(mb_labels)
        losses = [] if self.pp_has_last_stage else None
        with self.validation_context():
            pipeline_forward(
                self.pp_schedule,
                args if self.pp_has_first_stage else None,
                kwargs,
                targets,
                losses,
                loss_kwargs={"z_loss": False},
            )
        if not self.pp_has_last_stage:
            return None, None
        loss = torch.stack(losses).sum().to(self.device, non_blocking=True)
        return loss, (labels != IGNORE_INDEX).sum()

    def _report(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        perplexity = math.inf if loss > 700 else math.exp(loss)  # NaN stays NaN
        self.metrics_processor.logger.log({VALIDATION_TAG: loss, PERPLEXITY_TAG: perplexity}, step)
        # The training throughput logged next leaves the validation's time out.
        self.metrics_processor.time_last_log += seconds
        began, after = self._since
        trained = time.perf_counter() - seconds - began
        share = ""
        if step > after and trained > 0:
            share = (
                f", {100 * seconds / trained:.1f}% of the {trained:.1f}s the {step - after} "
                "steps before it took"
            )
        logger.info(
            f"validation at step {step}: loss {loss:.4f}, perplexity {perplexity:.4g} over "
            f"{tokens:,} held-out tokens in {seconds:.2f}s{share}"
        )
        self._since = (time.perf_counter(), step)
