"""`pdserve.core`'s flat module names of before its grouping still import, as the very same modules."""

import importlib
import warnings

import pytest

from pdserve.core._aliases import OLD_TO_NEW


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_an_old_name_is_the_new_module(old):
    new = importlib.import_module(OLD_TO_NEW[old])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module(old) is new

