"""Generate the built-in fine-tuning corpus, offload/data/corpus.txt (deterministic).

The corpus is English-like text with real structure for a small model to learn in a couple of
minutes: arithmetic facts spelled out, short descriptive sentences about places, animals and
machines built from a grammar, and question/answer pairs. It is generated (by this script,
written for the project) rather than copied from anywhere, so it carries no licence questions;
rerun it to reproduce the shipped file byte for byte.

    python scripts/make_corpus.py            # writes offload/data/corpus.txt
"""

from __future__ import annotations

import argparse
import os
import random

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
           "eighteen", "nineteen", "twenty"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "whale", "sparrow", "badger", "otter",
           "goat", "heron", "beetle", "salmon", "wolf"]
ANIMAL_TRAITS = {
    "cat": ("sleeps in the sun", "purrs", "hunts mice"), "dog": ("guards the house", "barks", "fetches sticks"),
    "fox": ("hides in the woods", "yelps", "hunts at dusk"), "owl": ("watches the night", "hoots", "hunts mice"),
    "horse": ("runs across the field", "neighs", "eats hay"), "rabbit": ("digs a burrow", "thumps", "eats clover"),
    "whale": ("swims in the deep sea", "sings", "eats krill"), "sparrow": ("nests under the roof", "chirps", "eats seeds"),
    "badger": ("digs at night", "grunts", "eats worms"), "otter": ("plays in the river", "whistles", "eats fish"),
    "goat": ("climbs the rocks", "bleats", "eats everything"), "heron": ("stands in the shallows", "croaks", "eats frogs"),
    "beetle": ("crawls under leaves", "clicks", "eats wood"), "salmon": ("swims up the river", "leaps", "eats insects"),
    "wolf": ("roams the hills", "howls", "hunts deer"),
}
PLACES = ["the harbour", "the old mill", "the market", "the library", "the station", "the orchard",
          "the lighthouse", "the bakery", "the bridge", "the workshop", "the school", "the garden"]
PEOPLE = ["Anna", "Ben", "Clara", "David", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
          "Kira", "Leo", "Mara", "Nils", "Olga", "Pavel"]
ACTIVITIES = ["bought bread", "read a book", "fixed a bicycle", "painted a fence", "wrote a letter",
              "planted tomatoes", "baked a cake", "caught a train", "sold apples", "met a friend",
              "lost a key", "found a coin"]
TIMES = ["in the morning", "at noon", "in the afternoon", "in the evening", "at night", "on Sunday",
         "on Monday", "after the rain", "before dinner"]
MACHINES = {
    "computer": "processor", "bicycle": "chain", "clock": "spring", "engine": "piston",
    "pump": "valve", "camera": "lens", "printer": "roller", "radio": "antenna", "loom": "shuttle",
}
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "grey", "brown"]


def arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 10), rng.randint(0, 10)
    op = rng.choice(["plus", "times", "minus"])
    if op == "plus":
        c = a + b
    elif op == "times":
        a, b = rng.randint(0, 4), rng.randint(0, 5)
        c = a * b
    else:
        a, b = max(a, b), min(a, b)
        c = a - b
    return f"{NUMBERS[a].capitalize()} {op} {NUMBERS[b]} is {NUMBERS[c]}."


def animal(rng: random.Random) -> str:
    name = rng.choice(ANIMALS)
    home, sound, food = ANIMAL_TRAITS[name]
    form = rng.randint(0, 3)
    if form == 0:
        return f"The {name} {home}."
    if form == 1:
        return f"Every {name} {sound} when it is afraid."
    if form == 2:
        return f"A {rng.choice(COLOURS)} {name} {food} near {rng.choice(PLACES)}."
    return f"Question: what does the {name} do? Answer: the {name} {food}."


def story(rng: random.Random) -> str:
    who, where, when = rng.choice(PEOPLE), rng.choice(PLACES), rng.choice(TIMES)
    what = rng.choice(ACTIVITIES)
    form = rng.randint(0, 2)
    if form == 0:
        return f"{who} {what} at {where} {when}."
    if form == 1:
        friend = rng.choice([p for p in PEOPLE if p != who])
        return f"{when.capitalize()}, {who} and {friend} walked to {where}, and {who} {what}."
    return f"Question: where did {who} go {when}? Answer: {who} went to {where}."


def machine(rng: random.Random) -> str:
    name, part = rng.choice(sorted(MACHINES.items()))
    form = rng.randint(0, 2)
    if form == 0:
        return f"The {part} is the heart of the {name}."
    if form == 1:
        return f"When the {part} breaks, the {name} stops working."
    return f"Question: which part makes the {name} work? Answer: the {part}."


def paragraph(rng: random.Random) -> str:
    makers = [arithmetic, animal, story, machine]
    topic = rng.choice(makers)
    sentences = [topic(rng) if rng.random() < 0.7 else rng.choice(makers)(rng)
                 for _ in range(rng.randint(3, 7))]
    return " ".join(sentences)


def make_corpus(target_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    paragraphs, size = [], 0
    while size < target_bytes:
        p = paragraph(rng)
        paragraphs.append(p)
        size += len(p) + 2
    return "\n\n".join(paragraphs) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=300_000, help="target size in bytes (default 300000)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "offload", "data",
                                                  "corpus.txt"))
    args = ap.parse_args()
    text = make_corpus(args.bytes, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {len(text.encode())} bytes to {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
