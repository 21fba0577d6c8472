"""Text and token data for training: tokenizers, the built-in corpus, files and streamed mixtures,
pre-tokenized shards (``canon-titan data tokenize``), document packing, and the synthetic tasks as
dataloaders; every loader is seeded, shards by data-parallel rank and saves its position."""
