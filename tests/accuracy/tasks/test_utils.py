"""Scoring hooks of the lm-eval tasks: what counts as the arithmetic answer."""

import pytest

from accuracy.tasks import utils


@pytest.mark.parametrize("response, answer, acc", [
    (" 42", 42, 1.0),
    (" 42.\nQuestion: 7", 42, 1.0),  # a sentence-ending period, then later numbers: the first one counts
    (" 1,200 pence", 1200, 1.0),
    (" 3.5", 3, 0.0),  # a decimal is not its integer part
    (" 42.0 pence", 42, 1.0),  # ... but a decimal with the same value is the answer
    (" -3", 3, 0.0),
    (" 43", 42, 0.0),
    (" 420", 42, 0.0),
    (" forty-two", 42, 0.0),
    (" 7 and then 42", 42, 0.0),  # only the first number is the answer
])
def test_arith_results(response, answer, acc):
    assert utils.arith_results({"answer": answer}, [response]) == {"acc": acc}


def test_needle_results_uses_the_whole_number_match():
    assert utils.needle_results({"target": "4793957"}, [" 4793957."]) == {"acc": 1.0}
    assert utils.needle_results({"target": "4793957"}, [" 14793957"]) == {"acc": 0.0}
