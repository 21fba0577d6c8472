"""Context parallelism (CP) for the attention families, with Canon layers.

Every CP rank holds a share of each sequence, split the way TorchTitan splits it (``cp_shard``:
with the ``headtail`` balancer, of 2 x cp equal chunks rank r holds chunk r and chunk 2 x cp - 1 -
r, so that causal attention costs every rank the same; without a balancer, one contiguous chunk).
The layers see it through ``ContextShards``, which the trainer hands every block as its
``attention_masks`` argument:

* attention gathers K and V of the whole sequence from the CP group (the design Llama 3 used;
  the gather's backward reduce-scatters their gradients). Causal attention then runs per
  contiguous run of the rank's queries against the keys before it, in global order: a run of n
  queries starting at global position g attends to the first g + n keys, causal aligned to the
  lower right (``torch.nn.attention.bias.causal_lower_right``), which the fused GPU kernels
  take as a flag and skip the masked blocks of. Each rank computes only its causal share of the
  scores (with the head-tail split, every rank the same share), and no mask is built. With
  document masking each run attends to the same keys under an explicit mask (causal and within a
  document) of its queries x those keys, every score of which is computed: the causal share
  again, not a mask of all the rank's queries x the whole sequence.
  Memory: SDPA keeps the gathered K and V for its backward, so each layer holds the whole
  sequence's K and V whatever the CP degree (2 x batch x seq x kv_heads x head_dim elements; the
  planner records them, as it records the real step); while a layer gathers, one more copy (the
  head-tail reorder) is alive.
* a Canon layer needs, for the first token of each contiguous run of its rows, the K - 1 tokens
  before it, which another rank holds (or none: the sequence start, where the convolution pads
  with zeros). Every rank all-gathers the last K - 1 rows of each of its runs (a halo exchange),
  and the Canon op reads a run's halo rows for the taps that reach back past its start, so its
  output equals the unsharded layer's exactly; the op's input is the rank's rows as they are (no
  copy with the halos in front).

The result is the unsharded model's on every token; the tests compare CP runs with one process.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from canon_titan.models.common.deferred import deferred

# TorchTitan's CP package imports its attention stack; the config checks read BALANCERS from here.
titan_cp = deferred("torchtitan.distributed.context_parallel")

BALANCERS = ("headtail", None)
"""Load balancers CP supports here (TorchTitan's ``ptrr`` needs a FlexAttention block mask)."""


def all_gather_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, its gradient reduce-scattered back. torch 2.13
    calls it ``all_gather_single_autograd`` (keeping ``all_gather_tensor_autograd`` as a deprecated
    alias); torch 2.11, the offline GPU kit's, has only the older name."""
    gather = (
        getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    )
    return gather(x, 0, group)


def contiguous_runs(index: list[int]) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive global positions."""
    runs, start = [], 0
    for i in range(1, len(index) + 1):
        if i == len(index) or index[i] != index[i - 1] + 1:
            runs.append((start, index[start], i - start))
            start = i
    return runs


def lower_right_causal_bias(queries: int, keys: int):
    """``torch.nn.attention.bias.causal_lower_right(queries, keys)`` without its storage: that
    constructor goes through ``torch.Tensor``'s legacy sizes constructor (its variant, an int
    enum, and the lengths are taken as sizes) and allocates an uninitialized fp32 tensor of at
    least [queries, keys] on the host (32 GiB for one rank of 8 at 262,144 tokens), which SDPA
    never reads (it dispatches on the bias's variant and lengths). Here the
    same subclass wraps an empty tensor."""
    # Imported here: the bias module imports torch._dynamo, and the config checks import this
    # module.
    from torch.nn.attention.bias import CausalBias, CausalVariant

    bias = torch.Tensor._make_subclass(CausalBias, torch.empty(0))
    bias.variant, bias.seq_len_q, bias.seq_len_kv = CausalVariant.LOWER_RIGHT, queries, keys
    return bias


@dataclass(eq=False)
class ContextShards:
    """Which positions of each sequence this CP rank holds, and the collectives that give its
    layers what they need from the other ranks."""

    group: dist.ProcessGroup
    rank: int
    size: int
    index: torch.Tensor
    """[L] global positions of this rank's rows, in local order."""
    runs: list[tuple[int, int, int]]
    """This rank's contiguous runs: (local start, global start, length)."""
    halo_sources: list[tuple[int, int] | None]
    """For each run, the (rank, run number) whose last rows precede it (None at position 0)."""
    max_runs: int = 1
    """The most runs a rank holds (headtail on 2 ranks: rank 0 holds 2, rank 1 one run of 2
    chunks)."""
    documents: torch.Tensor | None = None
    """[batch, seq] document number of every global position, when documents are masked."""
    global_order: torch.Tensor | None = None
    """Where each global position sits in a gather (None when the gather is in global order)."""
    causal_biases: list = dataclasses.field(default_factory=list)
    """For each run, its lower-right causal bias (None for a run from position 0: plain causal)."""

    def __post_init__(self):
        # Made here, in the trainer's eager hook: torch.compile cannot construct the bias (a tensor
        # subclass) inside a compiled block, and no tensor subclass can be constructed under the
        # dispatch modes that plans and counters run the step in, so these are made outside them.
        from torch.utils._python_dispatch import _disable_current_modes

        if (
            self.causal_biases
        ):  # a copy of built shards with other documents (``dataclasses.replace``)
            return
        with _disable_current_modes():
            self.causal_biases = [
                None if first == 0 else lower_right_causal_bias(length, first + length)
                for _, first, length in self.runs
            ]

    @classmethod
    def build(
        cls, group, positions: list[list[int]], device, documents: torch.Tensor | None = None
    ) -> ContextShards:
        """From the global positions every rank holds (``positions[r]``, in rank r's local
        order)."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        runs = [contiguous_runs(p) for p in positions]
        ends = {
            start + length: (r, j)
            for r, rank_runs in enumerate(runs)
            for j, (_, start, length) in enumerate(rank_runs)
        }
        sources = [None if start == 0 else ends[start] for _, start, _ in runs[rank]]
        gathered = [p for rank_positions in positions for p in rank_positions]
        order = sorted(range(len(gathered)), key=gathered.__getitem__)
        return cls(
            group=group,
            rank=rank,
            size=size,
            index=torch.tensor(positions[rank], device=device),
            runs=runs[rank],
            halo_sources=sources,
            max_runs=max(len(r) for r in runs),
            documents=documents,
            global_order=None if order == sorted(order) else torch.tensor(order, device=device),
        )

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, L, heads, dim] -> [batch, heads, S, dim] (S = size x L): the whole sequence in
        global order, a view of one [S, batch, heads, dim] tensor. The gather runs along the
        sequence (the local rows are moved to the front first, a copy of 1/size), so its output is
        the sequence in rank order; the head-tail split's reorder is one more copy. Two tensors of
        the whole sequence at most while it runs, one kept (for SDPA's backward)."""
        gathered = all_gather_autograd(x.transpose(0, 1).contiguous(), self.group)
        if self.global_order is not None:
            gathered = gathered.index_select(0, self.global_order)
        return gathered.permute(1, 2, 0, 3)

    @functools.cached_property
    def document_masks(self) -> list[torch.Tensor]:
        """For each run, [batch, 1, n, first + n]: its queries may see key j (global position j) if
        causal and in the same document."""
        masks = []
        for start, first, length in self.runs:
            queries, keys = (
                self.index[start : start + length],
                torch.arange(first + length, device=self.index.device),
            )
            causal = keys[None, :] <= queries[:, None]
            same = self.documents[:, queries, None] == self.documents[:, None, : first + length]
            masks.append((causal & same)[:, None])
        return masks

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool
    ) -> torch.Tensor:
        """Attention of this rank's queries to the whole sequence's keys: [batch, L, heads, dim]
        (the local q, k, v) -> [batch, L, heads, dim_v]. Each run of queries (n from global position
        first) attends to the keys before its end, in global order: lower-right causal, or with
        documents masked, an explicit [n, first + n] mask (every score of it computed)."""
        k, v = self.gather(k), self.gather(v)
        q = q.transpose(1, 2)
        masks = self.document_masks if self.documents is not None else self.causal_biases
        outs = []
        for (start, first, length), mask in zip(self.runs, masks):
            end = first + length
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, start : start + length],
                    k[:, :, :end],
                    v[:, :, :end],
                    attn_mask=mask,
                    is_causal=mask is None,
                    enable_gqa=enable_gqa,
                )
            )
        return torch.cat(outs, dim=2).transpose(1, 2)

    def halo(self, x: torch.Tensor, kernel_size: int, row_scale: torch.Tensor | None = None):
        """The ``kernel_size - 1`` rows before each of this rank's runs ([batch, runs * (K-1), C],
        run after run; zeros before the sequence start), and where the second run starts (-1 with
        one): what the Canon op reads for the taps that reach back past a run's start. With
        ``row_scale`` (a fused norm) the rows are ``x * row_scale`` in float32, as the op scales its
        input before the column scale; only the runs' last rows are scaled and gathered, not copies
        of the whole input."""
        k = kernel_size - 1
        tails = [x[:, start + length - k : start + length] for start, _, length in self.runs]
        if row_scale is not None:
            tails = [
                tail.float() * row_scale[:, start + length - k : start + length, None]
                for tail, (start, _, length) in zip(tails, self.runs)
            ]
        # the same size on every rank
        tails += [tails[0].new_zeros(tails[0].shape)] * (self.max_runs - len(self.runs))
        tails = torch.cat(tails, dim=1)
        gathered = all_gather_autograd(tails.contiguous(), self.group)
        # Every rank's tails, then k zero rows (the halo of the sequence start), as one tensor that
        # every rank's halos come from: the gather is in each rank's backward graph, so its
        # reduce-scatter runs on all of them (a rank that used none of it would skip it and hang).
        bank = torch.cat(
            [
                gathered.view(self.size, *tails.shape).movedim(0, 1).flatten(1, 2),
                tails.new_zeros(x.shape[0], k, x.shape[2]),
            ],
            dim=1,
        )
        zeros = self.size * tails.shape[1]
        firsts = [
            zeros if source is None else (source[0] * self.max_runs + source[1]) * k
            for source in self.halo_sources
        ]
        halo = torch.cat([bank[:, first : first + k] for first in firsts], dim=1)
        return halo, self.runs[1][0] if len(self.runs) > 1 else -1


def rank_positions(seq_len: int, size: int, load_balancer: str | None) -> list[list[int]]:
    """The global positions each of ``size`` CP ranks holds, in its local order, as TorchTitan's
    ``cp_shard`` splits the sequence: by PyTorch's head-tail load balancer
    (``_HeadTailLoadBalancer``: of 2 x size equal chunks, rank r holds chunk r then chunk 2 x size -
    1 - r), or in one contiguous chunk each. Every rank knows every rank's share without asking."""
    if load_balancer:
        chunk = seq_len // (2 * size)
        return [
            list(range(r * chunk, (r + 1) * chunk))
            + list(range((2 * size - 1 - r) * chunk, (2 * size - r) * chunk))
            for r in range(size)
        ]
    length = seq_len // size
    return [list(range(r * length, (r + 1) * length)) for r in range(size)]


def context_parallel_inputs(
    input_dict: dict, labels: torch.Tensor, cp_mesh, load_balancer: str | None
):
    """The trainer's hook: this rank's share of the tokens, labels and RoPE positions, and the
    ``ContextShards`` the blocks receive as ``attention_masks``."""
    inputs = input_dict["input"]
    batch, seq_len = inputs.shape
    positions = input_dict.get("positions")
    documents = torch.cumsum(positions == 0, dim=1) if positions is not None else None
    if positions is None:
        positions = torch.arange(seq_len, device=inputs.device).expand(batch, seq_len).contiguous()
    (inputs, labels, rope_positions), _ = titan_cp.cp_shard(
        cp_mesh, (inputs, labels, positions), None, load_balancer
    )
    shards = shard_layout(cp_mesh.get_group(), seq_len, load_balancer, inputs.device)
    if documents is not None:
        shards = dataclasses.replace(shards, documents=documents)
    return inputs, labels, {"positions": rope_positions, "attention_masks": shards}


@functools.lru_cache(maxsize=16)
def shard_layout(group, seq_len: int, load_balancer: str | None, device) -> ContextShards:
    """The ``ContextShards`` of a sequence length, built once: the split depends only on the length,
    the CP group and the balancer (building it walks every position in Python, 0.06 s of the host at
    262,144 tokens on 8 ranks, more on a busy one), and only the documents change from batch to
    batch."""
    return ContextShards.build(
        group, rank_positions(seq_len, dist.get_world_size(group), load_balancer), device
    )
