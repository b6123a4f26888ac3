"""Scenario files: the shipped ones load, derived sizes are right, mistakes are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsp.core.container import FIXED_HEADER_OCTETS
from kvsp.core.problems import ConfigurationError
from kvsp.sim.scenario import DEFAULT_SCENARIO, ModelShape, load_scenario, shipped


def test_shipped_scenarios_load_and_the_default_is_one_of_them() -> None:
    names = shipped()
    assert DEFAULT_SCENARIO in names
    assert {"h100-8b-16", "h100-8b-64", "cpu-smollm2-2"} <= set(names)
    default = load_scenario(DEFAULT_SCENARIO)
    assert default.instances.count == 16
    assert load_scenario("h100-8b-64").instances.count == 64


def test_an_8b_gqa_model_keeps_128_kib_per_token_and_64_mib_per_block() -> None:
    model = ModelShape()  # the defaults are Llama-3.1-8B's geometry
    assert model.token_octets == 128 * 1024
    assert model.block_octets == FIXED_HEADER_OCTETS + 16 * 32 + 512 * 128 * 1024
    assert ModelShape(block_tokens=16).compat_id != model.compat_id


def test_a_file_with_links_moments_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        'name = "two racks"\n'
        "[instances]\ncount = 4\ng1_blocks = 10\n"
        "[links]\nmbit_per_s = 1000\nrtt_us = 50\n"
        "[[links.pair]]\na = 0\nb = 3\nmbit_per_s = 10\nrtt_us = 900\n"
        "[[failures]]\ninstance = 2\nat_ms = 5000\n"
        "[[starts]]\ninstance = 3\nat_ms = 100\n"
    )
    s = load_scenario(path)
    assert s.name == "two racks"
    assert (s.instances.count, s.instances.g1_blocks, s.instances.g2_blocks) == (4, 10, 3000)
    assert s.link(0, 1) == (1000, 50)
    assert s.link(3, 0) == (10, 900)
    assert [(m.instance, m.at_ms) for m in s.failures] == [(2, 5000)]
    assert s.with_sizes(0.5).instances.g1_blocks == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[instances]\ncuont = 3\n", "unknown keys"),
        ("[instanse]\ncount = 3\n", "unknown tables"),
        ("[instances]\ncount = 0\n", "positive"),
        ("[[failures]]\ninstance = 99\nat_ms = 1\n", "no instance 99"),
        ("[links]\nmbit_per_s = [1]\n", "must be numbers"),
        ("not toml =", "scenario"),
    ],
)
def test_mistakes_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigurationError, match=message):
        load_scenario(path)
    with pytest.raises(ConfigurationError, match="cannot read"):
        load_scenario(tmp_path / "missing.toml")
