"""`aristax plan` in-process: register on a fresh parser, parse, run, read stdout."""

import argparse

import pytest

from aristax.planner import Plan
from aristax.planner.cli import parse_topology, register
from aristax.planner.topology import perlmutter


def parse(argv):
    parser = argparse.ArgumentParser(prog="aristax")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_plan_preset_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = parse(["plan", "perlmutter:2", "--experts", "16", "--top-k", "1", "--tokens", "512",
                  "--json", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "plan for perlmutter-2x4: 8 devices, 16 experts" in text
    assert "rounds" in text and "partitions (Lancet 5.1)" in text
    plan = Plan.from_json(out.read_text())
    # one table row per device, listing its experts
    rows = [l.split() for l in text.splitlines() if l.strip() and l.split()[0].isdigit() and len(l.split()) == 5]
    assert sorted(int(r[1]) for r in rows) == list(range(8))
    for r in rows:
        g = next(k for k, grp in enumerate(plan.groups) if int(r[1]) in grp)
        assert tuple(int(x) for x in r[4].split(",")) == plan.experts_on(g)[int(r[1])]


def test_plan_topology_file(tmp_path, capsys):
    path = tmp_path / "top.yaml"
    perlmutter(1).save(path)
    args = parse(["plan", str(path), "--experts", "8", "--d-model", "64", "--d-ff", "128"])
    assert args.func(args) == 0
    assert "4 devices, 8 experts" in capsys.readouterr().out


def test_bad_topology_spec():
    with pytest.raises(ValueError, match="preset"):
        parse_topology("nosuch:3")
    with pytest.raises(ValueError, match="integers"):
        parse_topology("perlmutter:x")
    with pytest.raises(ValueError, match="does not exist"):
        parse_topology("missing.yaml")
    assert parse_topology("heterogeneous_mix:1,1").num_devices == 12
