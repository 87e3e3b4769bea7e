"""Fixtures: tiny random Hugging Face Mixtral models saved to disk, loaded by aristax."""

from __future__ import annotations

import pytest

from mixtral_cases import CASES, Pair, make_hf
from aristax.models import Mixtral


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory) -> Pair:
    name = request.param
    hf = make_hf(CASES[name])
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return Pair(name, hf, Mixtral.from_pretrained(path), path)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory) -> Pair:
    """The first case only, for tests that need one model."""
    name = "top2_e4_gqa_window"
    hf = make_hf(CASES[name])
    path = tmp_path_factory.mktemp("small")
    hf.save_pretrained(path)
    return Pair(name, hf, Mixtral.from_pretrained(path), path)
