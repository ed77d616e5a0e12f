"""Every docstring example in the public package runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import gradmerge

MODULES = sorted(m.name for m in pkgutil.walk_packages(gradmerge.__path__, prefix="gradmerge."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
