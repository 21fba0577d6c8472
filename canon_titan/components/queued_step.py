"""The optimizer step with its host-to-device copies queued on the stream.

TorchTitan 0.3.0's ``Trainer.train_step`` moves each microbatch, and the step's count of tokens that
carry a loss, to the device with ``.to(device)``; a pipeline stage without the loss makes its
placeholder loss with ``torch.tensor(..., device=)``. On a GPU each of these copies waits for the
stream before it returns (torch synchronises after a copy without ``non_blocking``), so every step
began with the host waiting for the previous step's last kernel, and the GPU idled while the host
queued the next step's first ones. ``QueuedCopies`` makes the same step (the same microbatches, loss
normalisation, clipping, optimizer and scheduler steps, and logged metrics) with those copies
``non_blocking``, from pinned host memory: the data loaders build each batch in one pinned buffer
(``[dataloader] pin_memory``, on by default) whose views the batch's tensors are, and the step
copies that buffer once and takes the same views on the device (``tools/host_memory.to_device``);
the token count is kept in pinned memory too. A pinned block from torch's caching host allocator is
not reused before its copy has run, so the host's batch may be dropped at once. (From pageable
memory the driver stages the copy and may wait for the stream: ``scripts/benchmarks/host_syncs.py``
counts such a copy as a wait.) Not measured on a GPU yet (``scripts/benchmarks/gpu_check.py``'s
``syncs`` step does). ``tests/test_upstream.py`` pins the sources of the TorchTitan methods this
mirrors (``MIRRORED``), so that an upgrade that changes them is looked at here."""

from __future__ import annotations

import functools
import math

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.observability import structured_logger as sl
from torchtitan.tools.logging import logger

from canon_titan.components.divergence import NonFiniteLoss
from canon_titan.tools.host_memory import host_value, to_device

MIRRORED = {
    "Trainer.train_step": "911f8077fc175e7f",
    "Trainer.pp_forward_backward_step": "cabc5cbf434ef4f0",
}
"""TorchTitan 0.3.0's methods whose work ``QueuedCopies`` does, by the first 16 hex digits of the
SHA-256 of their source (held by tests/test_upstream.py)."""


class QueuedCopies:
    """A ``torchtitan.trainer.Trainer`` mixin: ``queued_train_step`` is its ``train_step`` with
    queued copies, and its pipeline step makes no blocking copy."""

    def queued_train_step(self, data_iterator) -> None:
        dims = self.parallel_dims
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        lr_metrics = self.lr_schedulers.get_metrics()
        should_log = self.metrics_processor.should_log(self.step)

        # The step's batches, one group of pipeline microbatches per gradient-accumulation step,
        # taken first: the loss of each is normalised by the tokens of them all.
        groups = []
        local_tokens = host_value(0, torch.int64)  # counted on the host, where the batches are
        for _ in range(self.gradient_accumulation_steps):
            group = []
            for _ in range(self.num_pipeline_parallel_microbatches):
                with sl.log_trace_span("fetching_batch"):
                    input_dict, labels = next(data_iterator)
                local_tokens += (labels != IGNORE_INDEX).sum()
                group.append((input_dict, labels))
            groups.append(group)
        sl.log_trace_scalar({"local_valid_tokens": int(local_tokens)})
        local_on_device = local_tokens.to(self.device, non_blocking=True)
        global_tokens = (
            dist_utils.dist_sum_tensor(local_on_device, dims.get_mesh("batch"))
            if dims.dp_enabled
            else local_on_device
        )

        accumulated = None
        for group in groups:
            inputs, labels = [], []
            for input_dict, host_labels in group:
                *values, on_device = to_device([*input_dict.values(), host_labels], self.device)
                inputs.append(dict(zip(input_dict, values)))
                labels.append(on_device)
            del group[:]  # the host's copies go as soon as they are queued
            if not dims.pp_enabled:
                inputs, labels = inputs[0], labels[0]
            loss = self.forward_backward_step(
                input_dict=inputs, labels=labels, global_valid_tokens=global_tokens
            )
            if should_log:
                loss = loss.detach()
                accumulated = loss.clone() if accumulated is None else accumulated.add_(loss)

        with sl.log_trace_span("optim"):
            grad_norm = dist_utils.clip_grad_norm_(
                [p for part in self.model_parts for p in part.parameters()],
                self.config.training.max_norm,
                foreach=True,
                pp_mesh=dims.get_optional_mesh("pp"),
                ep_enabled=dims.ep_enabled,
            )
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
        if should_log:
            self._log_step(accumulated, global_tokens, local_on_device, grad_norm, lr_metrics)

    def _log_step(self, accumulated, global_tokens, local_tokens, grad_norm, lr_metrics) -> None:
        """The logged step's metrics, as TorchTitan logs them: the loss averaged over every token of
        the batch, the largest rank's own average, the tokens seen; a non-finite loss stops the
        run."""
        dims = self.parallel_dims
        with sl.log_trace_span("collect_dist_metrics"):
            sl.log_trace_scalar({"global_valid_tokens": int(global_tokens)})
            if dims.dp_cp_enabled:
                mesh = dims.get_optional_mesh("loss")
                # ``accumulated`` is this rank's loss sum over the global token count: their sum
                # over ranks is the average, and times global / local tokens each rank's own
                # average.
                seen = host_value(self.ntokens_seen, torch.int64).to(self.device, non_blocking=True)
                average, largest, tokens_seen = (
                    dist_utils.dist_sum(accumulated, mesh),
                    dist_utils.dist_max(accumulated * global_tokens / local_tokens, mesh),
                    dist_utils.dist_sum(seen, mesh),
                )
            else:
                average = largest = float(accumulated.item())
                tokens_seen = self.ntokens_seen
        if not math.isfinite(average):
            raise NonFiniteLoss(f"the loss at step {self.step} is not finite ({average})")
        self.metrics_processor.log(
            self.step,
            average,
            largest,
            float(grad_norm.item()),
            extra_metrics={"n_tokens_seen": tokens_seen, **lr_metrics},
        )

    def pp_forward_backward_step(
        self, *, input_dict_mbs, label_mbs, global_valid_tokens
    ) -> torch.Tensor:
        """One pipeline schedule over the group's microbatches; the last stage returns the sum of
        their losses, the others a placeholder made on the device (no copy)."""
        args, kwargs, targets = [], [], [] if self.pp_has_last_stage else None
        for input_dict, labels in zip(input_dict_mbs, label_mbs, strict=True):
            inputs, labels, extra = self.post_dataloading_process(input_dict, labels)
            if self.pp_has_first_stage:
                args.append((inputs,))
            kwargs.append(extra)
            if targets is not None:
                targets.append(labels)
        losses = [] if self.pp_has_last_stage else None
        with self.train_context():
            self.pp_schedule.step(
                arg_mbs=args if self.pp_has_first_stage else None,
                kwarg_mbs=kwargs,
                target_mbs=targets,
                losses=losses,
                loss_kwargs={"global_valid_tokens": global_valid_tokens},
                return_outputs=False,
            )
        if self.pp_has_last_stage:
            loss = torch.stack(losses).sum()
            if loss.device.type != self.device.type:
                # TorchTitan's comment at its copy says PP + FSDP put the loss on the CPU; torch
                # 2.13's schedule keeps its loss function's output where the last stage ran. Should
                # it not, the copy back is a wait: said once, and the GPU check counts it.
                _say_loss_on(str(loss.device), str(self.device))
            return loss.to(self.device, non_blocking=True)
        return torch.full((1,), -1.0, device=self.device)


@functools.cache
def _say_loss_on(where: str, device: str) -> None:
    logger.warning(
        f"the pipeline schedule returned the loss on {where}, not {device}: a copy from "
        "the device inside the schedule and one back, every step"
    )
