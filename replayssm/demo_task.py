"""The demo model's task: GSM8K-like arithmetic word problems with checkable answers.

A problem is 2-3 steps of +, - or doubling on numbers below 100 (every intermediate value stays in
[0, 199]); its answer shows each step and ends with "The answer is N.":

    Q: Ann has 7 pens. She buys 5 more. She gives 3 away. How many pens does Ann have now? A: 7+5=12.
    12-3=9. The answer is 9.

(one line each, wrapped here). The demo model stops at the newline that ends every answer.

The held-out test set is the problems whose text hashes into bucket 0 of TEST_BUCKETS (stable
BLAKE2 hash); the training stream skips that bucket, so training never sees a test question.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

TEST_BUCKETS = 16
TEST_SEED = 20240047
NUM_TEST = 500
FEW_SHOT_SEED = 7
NAMES = [("Ann", "She"), ("Ben", "He"), ("Cara", "She"), ("Dan", "He"), ("Eva", "She"), ("Finn", "He"),
         ("Gia", "She"), ("Hugo", "He"), ("Ivy", "She"), ("Jack", "He"), ("Kim", "She"), ("Leo", "He"),
         ("Mia", "She"), ("Noah", "He"), ("Olga", "She"), ("Paul", "He")]
ITEMS = ["pens", "apples", "books", "coins", "cards", "shells", "stamps", "marbles", "cookies", "stickers",
         "eggs", "toys", "beads", "cups"]
# (sentence with {p} = pronoun and {b} = operand, operator); "*" doubles (its operand is 2).
ADD = ["{p} buys {b} more.", "{p} finds {b} more.", "{p} gets {b} more.", "A friend gives {o} {b} more."]
SUB = ["{p} gives {b} away.", "{p} loses {b}.", "{p} sells {b}.", "{p} uses {b}."]
DOUBLE = ["{p} doubles them."]
ANSWER = re.compile(r"The answer is (-?\d+)\.")


@dataclass(frozen=True)
class Problem:
    """One problem: `prompt` ends with "A:", `answer` is the rest of the line (with its newline)."""

    prompt: str
    answer: str
    value: int

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def generate_problem(rng: random.Random) -> Problem:
    """A random 2-3 step problem (module docstring) drawn from `rng`."""
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    value = rng.randint(2, 99)
    sentences, steps = [f"{name} has {value} {item}."], []
    for _ in range(rng.randint(2, 3)):
        kinds = ["+"] * (value < 199) + ["-"] * (value > 1) + ["*"] * (value < 100)
        op = rng.choice(kinds)
        if op == "+":
            b = rng.randint(1, min(99, 199 - value))
            new, template = value + b, rng.choice(ADD)
        elif op == "-":
            b = rng.randint(1, min(99, value))
            new, template = value - b, rng.choice(SUB)
        else:
            b, new, template = 2, 2 * value, rng.choice(DOUBLE)
        obj = "him" if pronoun == "He" else "her"
        sentences.append(template.format(p=pronoun, b=b, o=obj))
        steps.append(f"{value}{op}{b}={new}.")
        value = new
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    return Problem(f"Q: {question} A:", f" {' '.join(steps)} The answer is {value}.\n", value)


def is_test(problem: Problem) -> bool:
    """Whether the problem belongs to the held-out side of the split (hash bucket 0)."""
    digest = hashlib.blake2b(problem.prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % TEST_BUCKETS == 0


def held_out_set(n: int = NUM_TEST) -> list[Problem]:
    """The fixed held-out set: the first n distinct test-bucket problems of TEST_SEED's stream."""
    rng, seen, out = random.Random(TEST_SEED), set(), []
    while len(out) < n:
        p = generate_problem(rng)
        if is_test(p) and p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
    return out


def train_stream(seed: int):
    """An endless stream of training problems (never a test-bucket one)."""
    rng = random.Random(seed)
    while True:
        p = generate_problem(rng)
        if not is_test(p):
            yield p


def few_shot_prefix(k: int) -> str:
    """k solved training problems, one per line, shared by every question of an eval."""
    stream = train_stream(FEW_SHOT_SEED)
    return "".join(next(stream).text for _ in range(k))


def extract_answer(text: str) -> int | None:
    """The number of the first "The answer is N." in a generated answer, else None."""
    m = ANSWER.search(text)
    return int(m.group(1)) if m else None
