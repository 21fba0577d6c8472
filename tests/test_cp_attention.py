"""One CP rank's attention in one process: what it allocates and keeps, counted by a dispatch mode
of this file and autograd's saved-tensor hooks (rank 0 of 2 on a fake process group, where the
gathers move no data but allocate as on a GPU), and that it runs on a torch without 2.13's gather
name (a real one-rank gloo group, against plain causal SDPA). That its results equal the unsharded
model's is ``tests/test_context_parallel.py``'s, on two real processes."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

BATCH, LOCAL, HEADS, KV_HEADS, DIM = 2, 32, 6, 2, 16
"""Sizes at which no other tensor of the step has a whole sequence's K bytes."""


class NewStorages(TorchDispatchMode):
    """The bytes of every storage an op allocates for its outputs (not one of its inputs': a
    view)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {_storage(a) for a in torch.utils._pytree.tree_leaves((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        outputs = {
            _storage(o): o.dtype
            for o in (out if isinstance(out, (tuple, list)) else [out])
            if _storage(o) is not None
        }
        self.sizes += [
            (nbytes, dtype)
            for (address, nbytes), dtype in outputs.items()
            if (address, nbytes) not in inputs
        ]
        return out


def _storage(t) -> tuple[int, int] | None:
    """(address, bytes) of a plain tensor's storage; None for anything else (a collective's
    wrapper tensor has no storage of its own)."""
    if type(t) is not torch.Tensor:
        return None
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


@contextlib.contextmanager
def fake_rank_0_of_2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _qkv():
    return (
        torch.randn(BATCH, LOCAL, HEADS, DIM, requires_grad=True),
        torch.randn(BATCH, LOCAL, KV_HEADS, DIM, requires_grad=True),
        torch.randn(BATCH, LOCAL, KV_HEADS, DIM, requires_grad=True),
    )


@pytest.mark.parametrize("documents", [False, True])
def test_a_cp_ranks_attention_makes_two_whole_sequence_copies_of_k_and_v_and_keeps_one(documents):
    """Head-tail on 2 ranks (rank 0 holds chunks 0 and 3 of 4, c = 16 tokens each): the gather of K
    (and of V) allocates the whole sequence once and its reorder to global order once more; nothing
    else of that size (the gather used to make a third copy, turning [rank, batch] into [batch,
    rank]). SDPA's backward keeps one of them per K and V. With documents masked, each mask is a
    run's queries x the keys before its end (at most B x c x 4c), not the rank's queries x the whole
    sequence (B x 2c x 4c, which it was)."""
    from canon_titan.models.common.context_parallel import ContextShards, rank_positions

    seq = 2 * LOCAL
    whole = BATCH * seq * KV_HEADS * DIM * 4
    marks = torch.zeros(BATCH, seq, dtype=torch.long)
    marks[:, [0, 20, 40]] = 1
    with fake_rank_0_of_2() as group:
        shards = ContextShards.build(
            group,
            rank_positions(seq, 2, "headtail"),
            "cpu",
            torch.cumsum(marks, 1) if documents else None,
        )
        q, k, v = _qkv()
        saved = []

        def pack(t):
            saved.append(_storage(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), NewStorages() as new:
            shards.attention(q, k, v, enable_gqa=True)
    assert [n for n, _ in new.sizes if n == whole] == [
        whole
    ] * 4  # K: gathered, reordered; V: the same
    assert sorted(n for n in dict(s for s in saved if s).values() if n == whole) == [whole, whole]
    chunk = LOCAL // 2
    assert [(first, length) for _, first, length in shards.runs] == [(0, chunk), (3 * chunk, chunk)]
    if documents:
        assert max(n for n, dtype in new.sizes if dtype == torch.bool) == BATCH * chunk * 4 * chunk


def test_cp_attention_runs_on_a_torch_without_the_2_13_gather_name(monkeypatch, tmp_path):
    """torch 2.11 (the offline GPU kit's) has ``all_gather_tensor_autograd`` and not 2.13's
    ``all_gather_single_autograd``: without that name a CP rank's attention (here the only rank of
    a gloo group) gathers with the older one, and gives plain causal SDPA's output and gradients
    (grouped-query attention: fewer K/V heads)."""
    import torch.distributed._functional_collectives as funcol

    from canon_titan.models.common.context_parallel import ContextShards, rank_positions

    gather, used = funcol.all_gather_single_autograd, []
    monkeypatch.delattr(funcol, "all_gather_single_autograd")
    # 2.13's deprecated alias calls the newer name; 2.11's gathers itself, as the one kept here does
    monkeypatch.setattr(
        funcol, "all_gather_tensor_autograd", lambda *args: used.append(args) or gather(*args)
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        shards = ContextShards.build(dist.group.WORLD, rank_positions(LOCAL, 1, "headtail"), "cpu")
        q, k, v = _qkv()
        out = shards.attention(q, k, v, enable_gqa=True)
        out.square().sum().backward()
    finally:
        dist.destroy_process_group()
    assert len(used) == 2  # K and V
    got = (out, q.grad, k.grad, v.grad)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = F.scaled_dot_product_attention(
        q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    expected.square().sum().backward()
    for a, b in zip(got, (expected, q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(a, b)
