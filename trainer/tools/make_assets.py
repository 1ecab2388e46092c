"""Generate the trainer's shipped assets: a small text corpus and a byte-level BPE tokenizer.

Run from the repository root (deterministic; the outputs are committed)::

    .venv/bin/python trainer/tools/make_assets.py

Outputs under ``trainer/kubetitan_trainer/assets/``:

- ``corpus.jsonl``: a few hundred KB of structured English sentences (one JSON object with a
  ``text`` field per line) from a seeded generator. The sentences follow a small grammar with
  strong regularities (agreement, fixed phrase orders, recurring facts), so a tiny model's loss
  falls visibly within a hundred steps. Nothing is downloaded.
- ``tokenizer/tokenizer.json`` + ``tokenizer_config.json``: byte-level BPE trained on the corpus
  with the ``tokenizers`` library, vocabulary 2048 (torchtitan's debug model has
  ``vocab_size=2048`` and does not resize), BOS ``<|begin_of_text|>`` and EOS ``<|end_of_text|>``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parents[1] / "kubetitan_trainer" / "assets"
SEED = 20240607
N_DOCS = 1800
VOCAB_SIZE = 2048
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

NAMES = ["Ada", "Brook", "Cyril", "Dana", "Elio", "Fern", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena",
         "Milo", "Nora", "Otto", "Pia", "Quinn", "Rosa", "Sami", "Tess", "Uma", "Vito", "Wren", "Yara"]
ANIMALS = [("cat", "cats"), ("dog", "dogs"), ("fox", "foxes"), ("owl", "owls"), ("horse", "horses"),
           ("rabbit", "rabbits"), ("goat", "goats"), ("duck", "ducks"), ("bear", "bears"), ("frog", "frogs")]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "brown", "grey", "orange", "purple"]
PLACES = ["the garden", "the river", "the old barn", "the market", "the forest", "the hill",
          "the station", "the library", "the harbour", "the meadow", "the kitchen", "the bridge"]
VERBS = [("walks", "walk", "walked"), ("runs", "run", "ran"), ("sings", "sing", "sang"),
         ("reads", "read", "read"), ("sleeps", "sleep", "slept"), ("jumps", "jump", "jumped"),
         ("waits", "wait", "waited"), ("plays", "play", "played")]
FOODS = ["apples", "bread", "soup", "cheese", "carrots", "rice", "plums", "honey", "beans", "pie"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _sentence(rng: random.Random, facts: dict[str, tuple[str, str, str]]) -> str:
    name = rng.choice(NAMES)
    colour, (animal, _), place = facts[name]
    kind = rng.randrange(8)
    if kind == 0:
        return f"{name} has a {colour} {animal}."
    if kind == 1:
        s, _, _ = rng.choice(VERBS)
        return f"Every morning {name} {s} to {place}."
    if kind == 2:
        n = rng.randrange(2, 10)
        a, pl = rng.choice(ANIMALS)
        return f"There are {NUMBERS[n - 1]} {pl} near {place}."
    if kind == 3:
        _, _, past = rng.choice(VERBS)
        day = rng.choice(DAYS)
        return f"On {day}, {name} {past} with the {colour} {animal}."
    if kind == 4:
        food = rng.choice(FOODS)
        return f"The {animal} of {name} likes {food}, but {name} likes {rng.choice(FOODS)}."
    if kind == 5:
        i = rng.randrange(len(DAYS) - 1)
        return f"After {DAYS[i]} comes {DAYS[i + 1]}."
    if kind == 6:
        i = rng.randrange(len(NUMBERS) - 1)
        return f"{NUMBERS[i].capitalize()} and one make {NUMBERS[i + 1]}."
    return f"Where is the {colour} {animal}? It is in {place}."


def make_corpus(rng: random.Random) -> list[str]:
    # Each name owns one pet of one colour living in one place: recurring facts to learn.
    facts = {n: (rng.choice(COLOURS), rng.choice(ANIMALS), rng.choice(PLACES)) for n in NAMES}
    docs = []
    for _ in range(N_DOCS):
        docs.append(" ".join(_sentence(rng, facts) for _ in range(rng.randrange(4, 12))))
    return docs


def make_tokenizer(docs: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def main() -> None:
    rng = random.Random(SEED)
    docs = make_corpus(rng)
    ASSETS.mkdir(parents=True, exist_ok=True)
    with open(ASSETS / "corpus.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    tok = make_tokenizer(docs)
    out = ASSETS / "tokenizer"
    out.mkdir(exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "model_max_length": 8192}, indent=2) + "\n"
    )
    size = (ASSETS / "corpus.jsonl").stat().st_size
    print(f"Wrote {len(docs)} documents ({size / 1024:.0f} KiB) and a {tok.get_vocab_size()}-token tokenizer")


if __name__ == "__main__":
    main()
