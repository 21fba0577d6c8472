"""The built-in corpus and tokenizer: small, made by this project, no downloads.

``python -m canon_titan.data.builtin`` regenerates ``canon_titan/assets/builtin/`` (the files
are committed so that training needs no build step). The corpus is short English stories from
a seeded template grammar: each story introduces a character, a home town, a pet and an object,
and refers back to them later, so a model has both local syntax and longer-range facts to learn.
The held-out split (``[validation]`` of a run on the corpus) is the generator's next stories.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from canon_titan.tools.fileio import write_atomic

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "builtin"
CORPUS_FILE = "corpus.jsonl"
HELD_OUT_FILE = "held_out.jsonl"
"""The held-out split: the stories the generator writes after the corpus's (none of them in it)."""
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
VOCAB_SIZE = 2048
"""Upper bound for BPE training; the template grammar yields fewer distinct merges, and the
debug models keep 2048 embedding rows (a padded vocabulary, as usual)."""
NUM_STORIES = 3000
NUM_HELD_OUT = 300
SEED = 20261121

NAMES = [
    "Ada",
    "Ben",
    "Cleo",
    "Dov",
    "Esme",
    "Finn",
    "Gia",
    "Hugo",
    "Iris",
    "Jon",
    "Kaia",
    "Leo",
    "Mia",
    "Nils",
    "Olga",
    "Pia",
    "Quin",
    "Rosa",
    "Sami",
    "Tess",
    "Umar",
    "Vera",
    "Wes",
    "Xena",
    "Yuri",
    "Zoe",
]
TOWNS = [
    "Oakford",
    "Riverton",
    "Stonebridge",
    "Millbrook",
    "Ashwick",
    "Brightwater",
    "Cedarvale",
    "Dunmore",
    "Elmstead",
    "Foxhollow",
    "Greenhill",
    "Harborview",
]
PETS = ["cat", "dog", "parrot", "rabbit", "turtle", "goat", "hamster", "pony"]
PET_NAMES = ["Pip", "Biscuit", "Mochi", "Rusty", "Luna", "Pepper", "Ziggy", "Clover"]
OBJECTS = [
    "red kite",
    "old map",
    "blue lantern",
    "silver key",
    "wooden boat",
    "small drum",
    "green umbrella",
    "yellow ball",
    "paper crown",
    "brass compass",
]
PLACES = [
    "the market",
    "the river",
    "the forest",
    "the library",
    "the hill",
    "the bakery",
    "the harbor",
    "the garden",
    "the school",
    "the old mill",
]
FEELINGS = ["happy", "curious", "tired", "brave", "worried", "excited", "calm", "proud"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "foggy", "snowy", "bright"]
FOODS = ["apples", "bread", "soup", "cherries", "pancakes", "carrots", "cheese", "plums"]


def _story(rng: random.Random) -> str:
    name, town = rng.choice(NAMES), rng.choice(TOWNS)
    pet, pet_name, obj = rng.choice(PETS), rng.choice(PET_NAMES), rng.choice(OBJECTS)
    friend = rng.choice([n for n in NAMES if n != name])
    day = rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"])
    lines = [
        f"{name} lived in {town} with a {pet} called {pet_name}.",
        f"One {rng.choice(WEATHER)} {day}, {name} found a {obj} near {rng.choice(PLACES)}.",
    ]
    for _ in range(rng.randint(2, 6)):
        place, food = rng.choice(PLACES), rng.choice(FOODS)
        lines.append(
            rng.choice(
                [
                    f"{name} and {pet_name} walked to {place}.",
                    f"At {place}, {name} met {friend}, who was {rng.choice(FEELINGS)}.",
                    f'{friend} asked, "Where did you get the {obj}?"',
                    f'{name} said, "I found it near {place}, and I will keep it safe."',
                    f"They shared some {food} and talked about {town}.",
                    f"The {pet} was {rng.choice(FEELINGS)} and ran in circles.",
                    f"{name} counted {rng.randint(2, 12)} {food} and gave "
                    f"{rng.randint(1, 2)} to {friend}.",
                    f"It became {rng.choice(WEATHER)}, so {name} held the {obj} close.",
                ]
            )
        )
    lines.append(
        rng.choice(
            [
                f"In the evening, {name} went home to {town} with {pet_name} and the {obj}.",
                f"At night, {pet_name} the {pet} slept next to the {obj}, and {name} felt "
                f"{rng.choice(FEELINGS)}.",
                f"{name} told everyone in {town} about the {obj}.",
            ]
        )
    )
    return " ".join(lines)


def generate_corpus(num_stories: int = NUM_STORIES, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    return [_story(rng) for _ in range(num_stories)]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def corpus_jsonl(texts: list[str]) -> str:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts)


def write_assets(out_dir: Path = ASSET_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = generate_corpus(NUM_STORIES + NUM_HELD_OUT)
    texts, held_out = texts[:NUM_STORIES], texts[NUM_STORIES:]
    write_atomic(out_dir / CORPUS_FILE, corpus_jsonl(texts))
    write_atomic(out_dir / HELD_OUT_FILE, corpus_jsonl(held_out))
    tokenizer = train_tokenizer(texts)
    write_atomic(out_dir / "tokenizer.json", tokenizer.to_str())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
    }
    write_atomic(out_dir / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    write_assets()
    print(f"wrote {ASSET_DIR}")
