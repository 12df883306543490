"""The demo task: seeded problems, a held-out split that training never sees, checkable answers."""

from __future__ import annotations

import itertools
import random
import re

from replayssm.demo_task import (
    NUM_TEST,
    extract_answer,
    few_shot_prefix,
    generate_problem,
    held_out_set,
    is_test,
    train_stream,
)

STEP = re.compile(r"(\d+)([-+*])(\d+)=(\d+)\.")


def test_generator_is_deterministic():
    """The same seed gives the same problems, and the test set is the same on every call."""
    a = [p.text for p in itertools.islice(train_stream(3), 50)]
    b = [p.text for p in itertools.islice(train_stream(3), 50)]
    c = [p.text for p in itertools.islice(train_stream(4), 50)]
    assert a == b and a != c
    assert [p.text for p in held_out_set()] == [p.text for p in held_out_set()]


def test_test_set_is_held_out_from_training():
    """500 distinct test questions, none in 20,000 training problems or in the few-shot prefix."""
    test = {p.prompt for p in held_out_set()}
    assert len(test) == NUM_TEST
    train = {p.prompt for p in itertools.islice(train_stream(0), 20000)}
    assert not test & train
    assert not any(q in few_shot_prefix(8) for q in test)
    assert all(is_test(p) for p in held_out_set())
    assert not any(is_test(p) for p in itertools.islice(train_stream(1), 2000))


def test_answers_show_correct_steps():
    """Each answer chains 2-3 correct steps on operands below 100 and ends with the value it states."""
    rng = random.Random(5)
    for _ in range(2000):
        p = generate_problem(rng)
        steps = STEP.findall(p.answer)
        assert 2 <= len(steps) <= 3, p.text
        value = int(steps[0][0])
        assert f" has {value} " in p.prompt
        for a, op, b, c in steps:
            a, b, c = int(a), int(b), int(c)
            assert a == value and b < 100 and 0 <= c <= 199, p.text
            assert c == {"+": a + b, "-": a - b, "*": a * b}[op], p.text
            assert op == "*" or f" {b} " in p.prompt or f" {b}." in p.prompt, p.text
            value = c
        assert extract_answer(p.answer) == p.value == value
        assert p.prompt.endswith(" A:") and p.answer.endswith(".\n") and "\n" not in p.prompt


def test_extractor():
    """The first "The answer is N." counts; text without one gives None."""
    assert extract_answer(" 3+4=7. The answer is 7.\nQ: The answer is 8.") == 7
    assert extract_answer(" 3+4=7. The answer is -2.") == -2
    assert extract_answer(" 3+4=7. The answer is 7") is None
    assert extract_answer("") is None


def test_few_shot_prefix_is_k_solved_problems():
    """few_shot_prefix(k) is k complete problem lines, the same on every call."""
    prefix = few_shot_prefix(3)
    lines = prefix.splitlines()
    assert len(lines) == 3 and prefix.endswith("\n") and prefix == few_shot_prefix(3)
    assert all(line.startswith("Q: ") and extract_answer(line) is not None for line in lines)
    assert few_shot_prefix(0) == ""
