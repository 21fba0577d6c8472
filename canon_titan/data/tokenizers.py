"""Tokenizers of the released models, as TorchTitan tokenizers (``encode``/``decode``/``bos_id``).

- ``sentencepiece``: Llama-2's ``tokenizer.model`` (32,000 ids; BOS 1, EOS 2).
- ``tiktoken``: a Llama-3 style BPE ranks file plus 256 special tokens after the ranks
  (128,000 + 256 = 128,256 ids; BOS = first special = 128000, EOS = second = 128001).
- ``hf``: a Hugging Face ``tokenizer.json`` folder (TorchTitan's HuggingFaceTokenizer).

``path`` is the tokenizer file, or a folder holding ``tokenizer.model`` / the ranks file /
``tokenizer.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer

TOKENIZER_KINDS = ("hf", "sentencepiece", "tiktoken")
# Llama 3's pre-tokenisation pattern (the regex the released tokenizer was trained with).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_TIKTOKEN_SPECIAL = 256
# tiktoken recurses on very long runs without whitespace; encode long texts in pieces.
TIKTOKEN_CHUNK_CHARS = 400_000


def _find_file(path: str, names: tuple[str, ...]) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    for name in names:
        if (p / name).is_file():
            return p / name
    raise FileNotFoundError(f"{path}: no tokenizer file (looked for {', '.join(names)})")


def tiktoken_special_tokens(num_base: int) -> dict[str, int]:
    names = ["<|begin_of_text|>", "<|end_of_text|>"]
    names += [f"<|reserved_special_token_{i}|>" for i in range(NUM_TIKTOKEN_SPECIAL - len(names))]
    return {name: num_base + i for i, name in enumerate(names)}


class _AddSpecials:
    bos_id: int | None
    eos_id: int | None

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids


class SentencePieceTokenizer(_AddSpecials, BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str):
        super().__init__()
        from sentencepiece import SentencePieceProcessor

        self.model = SentencePieceProcessor(
            model_file=str(_find_file(tokenizer_path, ("tokenizer.model",)))
        )
        self.bos_id = self.model.bos_id() if self.model.bos_id() >= 0 else None
        self.eos_id = self.model.eos_id() if self.model.eos_id() >= 0 else None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self._wrap(self.model.encode(text), add_bos, add_eos)

    def decode(self, ids) -> str:
        return self.model.decode(list(ids))

    def get_vocab_size(self) -> int:
        return self.model.vocab_size()


class TiktokenTokenizer(_AddSpecials, BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str):
        super().__init__()
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = _find_file(tokenizer_path, ("tokenizer.model", "tokenizer.tiktoken"))
        ranks = load_tiktoken_bpe(str(path))
        specials = tiktoken_special_tokens(len(ranks))
        self.encoding = tiktoken.Encoding(
            name=path.stem, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        self.bos_id, self.eos_id = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids: list[int] = []
        for start in range(0, len(text), TIKTOKEN_CHUNK_CHARS):
            # Special-token strings inside documents are ordinary text.
            ids.extend(
                self.encoding.encode(
                    text[start : start + TIKTOKEN_CHUNK_CHARS],
                    allowed_special=set(),
                    disallowed_special=(),
                )
            )
        return self._wrap(ids, add_bos, add_eos)

    def decode(self, ids) -> str:
        return self.encoding.decode(list(ids))

    def get_vocab_size(self) -> int:
        return self.encoding.n_vocab


def tokenizer_config(kind: str) -> BaseTokenizer.Config:
    return {
        "hf": HuggingFaceTokenizer.Config,
        "sentencepiece": SentencePieceTokenizer.Config,
        "tiktoken": TiktokenTokenizer.Config,
    }[kind]()


def build_tokenizer(kind: str, path: str) -> BaseTokenizer:
    return tokenizer_config(kind).build(tokenizer_path=str(path))


def folder_tokenizer_kind(folder: str | Path) -> str | None:
    """The kind of the tokenizer in a model folder: the first of ``TOKENIZER_KINDS`` that loads
    from it, or None when none does."""
    for kind in TOKENIZER_KINDS:
        try:
            build_tokenizer(kind, str(folder))
        except Exception:  # each library fails on another kind's file in its own way
            continue
        return kind
    return None
