"""Topology validation, presets and (de)serialisation."""

import numpy as np
import pytest

from aristax.planner import topology as topology_module
from aristax.planner.topology import MB, Topology, dgx_h100, heterogeneous_mix, perlmutter, uniform


def _small(**over):
    kw = dict(alpha=np.array([[0, 1e-5], [1e-5, 0]]), beta=np.array([[0, 1e-11], [1e-11, 0]]),
              flops=[1e14, 1e14], expert_capacity=[4, 4])
    kw.update(over)
    return Topology(**kw)


@pytest.mark.parametrize(
    "over, field",
    [
        (dict(alpha=np.zeros((2, 3))), "alpha"),
        (dict(beta=np.zeros((3, 3))), "beta"),
        (dict(flops=[1e14]), "flops"),
        (dict(expert_capacity=[1, 2, 3]), "expert_capacity"),
        (dict(alpha=np.array([[0, -1.0], [-1.0, 0]])), "alpha"),
        (dict(alpha=np.array([[0, 1e-5], [2e-5, 0]])), "alpha"),
        (dict(beta=np.array([[0, np.inf], [np.inf, 0]])), "beta"),
        (dict(flops=[0.0, 1e14]), "flops"),
        (dict(expert_capacity=[1.5, 2]), "expert_capacity"),
        (dict(node=[0]), "node"),
        (dict(node=[0.7, 1.9]), "node must hold integer host ids"),  # was truncated to [0, 1]
        (dict(symmetric="false"), "symmetric must be true or false"),  # a string was true
    ],
)
def test_validation_names_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        _small(**over)


@pytest.mark.parametrize("make, arg", [("perlmutter", 2.5), ("perlmutter", "2"), ("dgx_h100", 1.0),
                                       ("uniform", True), ("heterogeneous_mix", 0.5)])
def test_presets_called_directly_refuse_a_count_that_is_not_an_integer(make, arg):
    """perlmutter(2.5) raised NumPy's TypeError from inside, perlmutter('2') a TypeError
    about '<'; preset() checked them, the direct calls did not."""
    with pytest.raises(ValueError, match=f"must be an integer, got {arg!r}"):
        getattr(topology_module, make)(arg)


def test_asymmetric_allowed_when_declared():
    t = _small(alpha=np.array([[0, 1e-5], [2e-5, 0]]), symmetric=False)
    assert t.alpha[1, 0] == 2e-5


def test_perlmutter_numbers():
    t = perlmutter(2)
    assert t.num_devices == 8
    assert t.alpha[0, 1] == pytest.approx(9e-6) and t.alpha[0, 4] == pytest.approx(30e-6)
    # 0.014 ms/MB and 0.054 ms/MB: 1 MB takes 14 us inside a node, 54 us across
    assert t.beta[0, 1] * MB == pytest.approx(14e-6) and t.beta[0, 4] * MB == pytest.approx(54e-6)
    assert list(t.node) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (t.expert_capacity == 32).all()


def test_dgx_and_mix():
    d = dgx_h100(2)
    assert d.num_devices == 16 and d.alpha[0, 7] < d.alpha[0, 8] and d.beta[0, 7] < d.beta[0, 8]
    m = heterogeneous_mix(1, 2)
    assert m.num_devices == 16 and len(set(m.node.tolist())) == 3
    assert m.flops[0] > m.flops[-1]
    # across the two kinds the slow link applies; inside an A100 node the NVLink one
    assert m.alpha[0, 8] == pytest.approx(30e-6) and m.alpha[8, 9] == pytest.approx(9e-6)
    assert m.alpha[0, 1] == pytest.approx(3e-6)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_roundtrip(tmp_path, suffix):
    for t in (perlmutter(2), heterogeneous_mix(), _small(alpha=np.array([[0, 1e-5], [2e-5, 0]]), symmetric=False)):
        path = tmp_path / f"t{suffix}"
        t.save(path)
        assert Topology.load(path) == t


def test_preset_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: perlmutter\nnodes: 3\n")
    assert Topology.load(path) == perlmutter(3)
    path.write_text("preset: nope\n")
    with pytest.raises(ValueError, match="preset"):
        Topology.load(path)
    path.write_text("alpha: [[0]]\n")
    with pytest.raises(ValueError, match="missing"):
        Topology.load(path)


def test_p2p_time():
    t = uniform(3, alpha=1.0, beta=0.5)
    np.testing.assert_allclose(t.p2p_time(2.0), [[0, 2, 2], [2, 0, 2], [2, 2, 0]])
