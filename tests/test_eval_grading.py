"""Grader tests on real MATH-500 / GSM8K answer formats (gold answers read from the shipped data by id)."""

import pytest

from epikv.data import data_dir, read_jsonl
from epikv.eval.grading import grade, last_boxed, math_verify_equal, strict_equal, to_number


@pytest.fixture(scope="module")
def gold():
    return {r["id"]: r["answer"] for r in read_jsonl(data_dir() / "math500.jsonl")}


# (MATH-500 id, model's boxed answer, math-verify verdict, strict verdict)
CASES = [
    ("test/algebra/2584.json", r"\dfrac{14}{3}", True, True),  # fraction, \dfrac normalised
    ("test/algebra/2584.json", "14/3", True, False),  # slash fraction: strict misses it
    ("test/algebra/2584.json", r"\frac{13}{3}", False, False),
    ("test/prealgebra/1302.json", r"11\sqrt{2}", True, False),  # the strict matcher's known false negative
    ("test/prealgebra/1302.json", r"11\sqrt2", True, True),
    ("test/algebra/2036.json", r"3\sqrt{13}", True, True),  # radical
    ("test/algebra/2043.json", r"(-\infty,2)\cup(3,\infty)", True, True),  # interval union, spaces dropped
    ("test/algebra/2043.json", r"(-\infty,2]\cup(3,\infty)", False, False),  # closed end: wrong
    ("test/precalculus/695.json", r"(-\infty,0]", True, True),
    ("test/precalculus/927.json", r"90^\circ", True, True),  # degrees
    ("test/precalculus/927.json", "90", True, False),  # degrees dropped: equivalent, not string-equal
    ("test/algebra/1349.json", "Evelyn", True, True),  # text answer, \text{} unwrapped
    ("test/algebra/1349.json", "Bob", False, False),
    ("test/intermediate_algebra/428.json", "7, 5, 3", True, True),  # comma list in any order
    ("test/intermediate_algebra/956.json", "(31,6,-1)", False, False),  # an ordered tuple is not a set
    ("test/precalculus/807.json", r"(3, \dfrac{\pi}{2})", True, True),  # \left( \right) stripped
    ("test/prealgebra/1003.json", r"\frac{270}{7}", True, False),  # gold carries "\text{ degrees}"
]


@pytest.mark.parametrize("pid,pred,mv,strict", CASES)
def test_math500_formats(gold, pid, pred, mv, strict):
    g = gold[pid]
    assert math_verify_equal(pred, g) is mv
    assert strict_equal(pred, g) is strict
    out = grade(f"Some reasoning with \\boxed{{0}} first.\nSo the answer is $\\boxed{{{pred}}}$.", g)
    assert out["final_answer"] == pred  # the LAST box of the whole output
    assert out["correct"] is mv and out["correct_strict"] is strict


def test_nested_braces_and_last_box():
    assert last_boxed(r"\boxed{\frac{\sqrt{3}}{2}}") == r"\frac{\sqrt{3}}{2}"
    assert last_boxed(r"a \boxed{1} b \boxed{\left\{ 1, 2 \right\}} c") == r"\left\{ 1, 2 \right\}"
    assert last_boxed(r"first \boxed{7} then cut off \boxed{\frac{1") == "7"  # unbalanced box at the cap
    assert last_boxed(r"\boxed 5.") == "5."
    assert last_boxed("no box here: 42") is None
    out = grade("The answer is 42.", "42", integer=True)
    assert out == {"final_answer": None, "correct": False, "correct_strict": False, "correct_lenient": True}
    assert not grade("The answer is 41, not 4.", "42", integer=True)["correct_lenient"]
    assert grade("She pays $1,234.", "1234", integer=True)["correct_lenient"]


def test_gsm8k_integers():
    rows = {r["id"]: r for r in read_jsonl(data_dir() / "gsm8k_test.jsonl")[:40]}
    g = rows["gsm8k_test_0000"]["answer_norm"]
    for pred in [g, f"\\${g}", f"{g}.00", f"\\text{{{g} dollars}}", f"x = {g}"]:
        assert grade(f"\\boxed{{{pred}}}", g, integer=True)["correct"], pred
    assert not grade(f"\\boxed{{{int(g) + 1}}}", g, integer=True)["correct"]
    comma = next(r for r in read_jsonl(data_dir() / "gsm8k_test.jsonl") if "," in r["answer"])
    assert grade(f"\\boxed{{{comma['answer']}}}", comma["answer_norm"], integer=True)["correct"]
    assert to_number("1,234") == 1234 and to_number(r"\frac{3}{4}") * 4 == 3 and to_number("seven") is None


def test_aime_leading_zeros():
    rows = read_jsonl(data_dir() / "aime2024.jsonl")
    r = next(r for r in rows if r["answer"].startswith("0"))
    assert grade(f"\\boxed{{{r['answer_norm']}}}", r["answer"], integer=True)["correct"]
