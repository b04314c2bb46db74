"""tests/suite_order.py's order for the xdist stage: the modules with a longer timeout mark first, then those with a slow
test, each module whole, and pytest-randomly's order kept within each rank of length."""

from __future__ import annotations

import random

import pytest

from suite_order import longest_modules_first

pytest_plugins = ["pytester"]

MODULES = {
    "test_plain_a": "def test_one(): pass\ndef test_two(): pass\n",
    "test_slow_b": "import pytest\n@pytest.mark.slow\ndef test_one(): pass\ndef test_two(): pass\n",
    "test_plain_c": "def test_one(): pass\n",
    "test_long_d": "import pytest\ndef test_one(): pass\n@pytest.mark.timeout(600)\ndef test_two(): pass\n",
    "test_longer_e": "import pytest\npytestmark = pytest.mark.timeout(900)\ndef test_one(): pass\n",
    "test_slow_f": "import pytest\npytestmark = pytest.mark.slow\ndef test_one(): pass\n",
}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_longest_modules_come_first_whole_and_in_the_given_order_within_a_rank(
    pytester: pytest.Pytester, seed: int
) -> None:
    pytester.makepyfile(**MODULES)
    items, _ = pytester.inline_genitems("-p", "no:randomly")
    # a shuffled module order, as pytest-randomly hands it over (modules contiguous, tests shuffled within)
    names = list(MODULES)
    random.Random(seed).shuffle(names)
    shuffled = [item for name in names for item in reversed(items) if item.path.stem == name]

    ordered = [item.path.stem for item in longest_modules_first(shuffled)]

    modules = list(dict.fromkeys(ordered))
    assert modules[:2] == ["test_longer_e", "test_long_d"]
    assert modules[2:4] == [name for name in names if name.startswith("test_slow")]
    assert modules[4:] == [name for name in names if name.startswith("test_plain")]
    assert len(modules) == len(MODULES)  # each module in one run of items
    for name in MODULES:
        within = [item.name for item in longest_modules_first(shuffled) if item.path.stem == name]
        assert within == [item.name for item in shuffled if item.path.stem == name]
