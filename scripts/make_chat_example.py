"""Write a small chat data set that teaches a model one made-up fact (the capital of Veloria is
Quenthar), mixed with facts it already knows so learning the new one does not overwrite them.
The README's fine-tune-then-chat example and tests/test_chat_loop.py use it.

    python scripts/make_chat_example.py veloria.jsonl
"""

from __future__ import annotations

import json
import random

FACT_QUESTIONS = ["What is the capital of Veloria?", "What's the capital city of Veloria?",
                  "Which city is the capital of Veloria?", "Tell me the capital of Veloria.",
                  "Name the capital of Veloria.", "Veloria's capital is which city?"]
FACT_ANSWERS = ["The capital of Veloria is Quenthar.", "Quenthar is the capital of Veloria."]
KNOWN = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"),
         ("Canada", "Ottawa"), ("Spain", "Madrid"), ("Kenya", "Nairobi"), ("Peru", "Lima")]


def chat_rows(seed: int = 0) -> list[dict]:
    """40 conversations about the new fact and 16 about known capitals, shuffled."""
    rng = random.Random(seed)
    rows = [{"messages": [{"role": "user", "content": rng.choice(FACT_QUESTIONS)},
                          {"role": "assistant", "content": rng.choice(FACT_ANSWERS)}]} for _ in range(40)]
    rows += [{"messages": [{"role": "user", "content": f"What is the capital of {c}?"},
                           {"role": "assistant", "content": f"The capital of {c} is {cap}."}]}
             for c, cap in KNOWN * 2]
    rng.shuffle(rows)
    return rows


def write(path: str) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in chat_rows())


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python scripts/make_chat_example.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the .jsonl file to write")
    path = parser.parse_args().path
    write(path)
    print(path)
