"""Optional dependencies: present ones import, missing ones name the package and the install step."""

from __future__ import annotations

import json

import pytest

from spartron.optional import MissingDependencyError, require


def test_present_module_is_returned():
    assert require("json", "config dumps", "pip install nothing") is json


def test_missing_module_names_package_feature_and_hint():
    with pytest.raises(MissingDependencyError) as err:
        require("deep_ep_not_installed_here", "moe.dispatcher = 'deepep'", "build DeepEP v1.2.1 from source")
    text = str(err.value)
    assert text.startswith("moe.dispatcher = 'deepep' needs the Python package 'deep_ep_not_installed_here'")
    assert text.endswith("Install it: build DeepEP v1.2.1 from source")
    assert isinstance(err.value, ImportError) and isinstance(err.value.__cause__, ModuleNotFoundError)
