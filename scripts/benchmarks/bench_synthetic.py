"""Synthetic data generation vs training consumption, per process.

For every task at its reference preset (and the playground's CPU sizes), measures how many
tokens per second one process generates and packs (``SyntheticDataLoader``), and how many tokens
per second one training process consumes at the debug model shape (forward + backward + AdamW
step of ``llama_canon`` debug on this machine, same sequence length). Generation is not the
bottleneck when the ratio is well above 1.

  python scripts/benchmarks/bench_synthetic.py [--threads 1] [--windows 32] [--model llama_canon]
"""

from __future__ import annotations

import argparse
import time

import torch

import model_registry
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.data.synthetic import SyntheticDataLoader
from canon_titan.data.tokenizers import build_tokenizer
from synthetic_data.tasks import make_task

CASES = [  # (label, dataset, task overrides)
    ("depo1", "depo1", {}),
    ("depo2", "depo2", {}),
    ("brevo1", "brevo1", {}),
    ("brevo2", "brevo2", {}),
    ("mano", "mano", {}),
    ("lano (cfg3f-like)", "lano", {}),
    ("capo_bios", "capo_bios", {"individuals": 10000}),
    ("depo1 playground", "depo1", {"N": 16, "K": 8, "mini_vocab": 16, "max_word_len": 2}),
    ("mano playground", "mano", {"L": 4}),
]


def seq_len_for(dataset: str, task: dict) -> int:
    longest = make_task(dataset, **task).max_length() or 512
    length = 128
    while length + 1 < longest:
        length *= 2
    return length


def generation_rate(dataset, task, seq_len, windows, tokenizer) -> float:
    config = SyntheticDataLoader.Config(
        dataset=dataset, task=task, answer_only_loss=dataset != "capo_bios"
    )
    loader = SyntheticDataLoader(
        config, dp_world_size=1, dp_rank=0, seq_len=seq_len, local_batch_size=1, tokenizer=tokenizer
    )
    started = time.perf_counter()
    for w in range(100, 100 + windows):
        loader.window(w)
    return windows * seq_len / (time.perf_counter() - started)


def training_rate(model_name: str, seq_len: int, batch: int, vocab: int, steps: int = 3) -> float:
    model = model_registry.model_spec(
        model_name, "debug", {"vocab_size": vocab, "max_seq_len": seq_len}
    ).model.build()
    model.init_states()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(1, vocab, (batch, seq_len + 1))
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return batch * seq_len / (sum(times[1:]) / steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (one training process each)"
    )
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--model", default="llama_canon")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer("hf", str(ASSET_DIR))
    train_cache: dict[tuple[int, int], float] = {}
    print(f"{'task':<20} {'seq_len':>7} {'generated tok/s':>16} {'trained tok/s':>14} {'ratio':>7}")
    for label, dataset, task in CASES:
        seq_len = seq_len_for(dataset, task)
        vocab = 10000 if dataset != "capo_bios" else tokenizer.get_vocab_size()
        gen = generation_rate(dataset, task, seq_len, args.windows, tokenizer)
        key = (seq_len, vocab)
        if key not in train_cache:
            train_cache[key] = training_rate(args.model, seq_len, args.batch, vocab)
        train = train_cache[key]
        print(
            f"{label:<20} {seq_len:>7} {gen:>16,.0f} {train:>14,.0f} {gen / train:>6.0f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
