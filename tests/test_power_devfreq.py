"""Discovery of the Jetson GPU devfreq node and the choice of floor frequencies, on fake sysfs trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from moestream.power.clockfloor import FloorPlan, plan_for
from moestream.power.devfreq import find_gpu_devfreq, find_jetson_gpu, is_tegra
from moestream.power.testing import make_fake_jetson, set_value


def test_finds_orin_gpu_node_and_reads_frequencies(tmp_path: Path) -> None:
    make_fake_jetson(tmp_path, min_mhz=408)
    node = find_jetson_gpu(tmp_path)
    assert node is not None and node.name == "17000000.gpu"
    assert node.available_hz()[0] == 306_000_000 and node.available_hz()[-1] == 1_020_000_000
    assert (node.min_hz(), node.max_hz(), node.cur_hz()) == (408_000_000, 1_020_000_000, 306_000_000)
    assert node.governor() == "nvhost_podgov"
    set_value(node.path / "device/load", 362)
    assert node.load_permille() == 362


def test_tegra_chip_name_is_enough_without_device_tree(tmp_path: Path) -> None:
    make_fake_jetson(tmp_path, name="17000000.gv11b", tegra=False)
    assert not is_tegra(tmp_path)
    node = find_jetson_gpu(tmp_path)
    assert node is not None and node.name == "17000000.gv11b"


def test_generic_gpu_name_on_a_non_tegra_board_is_not_a_jetson(tmp_path: Path) -> None:
    # "*.gpu" devfreq nodes also exist on other SoCs (e.g. Mali): never raise their floor on "auto".
    make_fake_jetson(tmp_path, name="ff9a0000.gpu", tegra=False)
    assert find_gpu_devfreq(tmp_path) is not None
    assert find_jetson_gpu(tmp_path) is None


def test_no_devfreq_at_all(tmp_path: Path) -> None:
    assert find_gpu_devfreq(tmp_path) is None and find_jetson_gpu(tmp_path) is None


def test_unrelated_devfreq_nodes_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "sys/class/devfreq/3d00000.nvdla").mkdir(parents=True)
    (tmp_path / "sys/class/devfreq/3d00000.nvdla/min_freq").write_text("1\n")
    assert find_gpu_devfreq(tmp_path) is None


def test_default_plan_is_highest_allowed_by_max_freq_and_lowest_when_idle(tmp_path: Path) -> None:
    make_fake_jetson(tmp_path)
    node = find_jetson_gpu(tmp_path)
    assert node is not None
    plan = plan_for(node, None)
    assert (plan.target_hz, plan.idle_hz, plan.hold_s) == (1_020_000_000, 306_000_000, 1.0)
    set_value(node.path / "max_freq", 816_000_000)  # nvpmodel capped the board
    assert plan_for(node, None).target_hz == 816_000_000


def test_mhz_plan_rounds_up_to_an_available_frequency(tmp_path: Path) -> None:
    make_fake_jetson(tmp_path)
    node = find_jetson_gpu(tmp_path)
    assert node is not None
    assert plan_for(node, 700).target_hz == 714_000_000
    assert plan_for(node, 1020, hold_s=2.5) == FloorPlan(1_020_000_000, 306_000_000, 2.5)
    with pytest.raises(ValueError, match="above the highest"):
        plan_for(node, 1300)


@pytest.mark.parametrize(
    "kwargs",
    [dict(target_hz=0, idle_hz=1), dict(target_hz=5, idle_hz=6), dict(target_hz=6, idle_hz=5, hold_s=-1.0)],
)
def test_floor_plan_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        FloorPlan(**kwargs)
