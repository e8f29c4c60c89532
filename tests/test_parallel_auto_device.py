"""`--parallel auto` on a ggml backend (engine/device_parallel.py): the slots chosen by the device's free
memory, checked on ggml's CPU backend (MOESTREAM_GGML_BACKEND=cpu, the device path CUDA runs) with its
`memory()` made to report chosen free bytes.

The rule as a pure function with given numbers; then loads of a tiny model whose free memory is built
from the plan's own numbers (`device_needs`, `tier_room`: what the runner sizes its tier from), so the
expected choice is known: 4, 2 or 1 under `--gpu-tier auto` and under an explicit tier, the mode line's
words, the runner's tier the one the choice counted on; a backend that does not say its memory; and two
prompts decoded together in the slots chosen, each getting its tokens alone.
"""

from __future__ import annotations

import pytest
import torch
from test_batch_runner import STEPS, _alone, _stepped

import moestream
from moestream.engine.device_parallel import choose_device_slots
from moestream.engine.ggml_runner import CHUNK, DEVICE_CHUNK, DeviceNeeds, device_needs, planned_bytes
from moestream.engine.gpu_tier import AUTO_MARGIN, tier_room
from moestream.engine.options import AUTO
from moestream.ggml.backend import Backend
from moestream.units import MiB, format_size

WHERE = "the GPU"
PROMPTS = [[5, 17, 33, 2, 99, 41, 7], [250, 3, 12, 80]]


# --- the rule, with given numbers ------------------------------------------------------------------


def _needs(every: int = 1000 * MiB, holds_all: bool = True) -> dict[int, DeviceNeeds]:
    """Slots' KV cache 16 MiB each, graphs 100 MiB + 10 MiB a slot, a trunk of 1000 MiB."""
    return {
        n: DeviceNeeds(
            n, 16 * MiB * n, (100 + 10 * n) * MiB, (1100 + 26 * n) * MiB, every, 8 * MiB, holds_all
        )
        for n in (4, 2, 1)
    }


def _free(reserve: int, keep: int) -> int:
    """The least free memory that leaves `keep` bytes after `reserve` and the margin (AUTO_MARGIN here)."""
    free = reserve + keep + AUTO_MARGIN
    assert free // 20 <= AUTO_MARGIN and tier_room(free, reserve) == keep > tier_room(free - 1, reserve)
    return free


def test_every_expert_on_the_device_with_one_slot_must_stay_there():
    needs = _needs()
    every = needs[1].every
    free = _free(needs[4].reserve, every)
    assert choose_device_slots(free, needs, AUTO, 512, WHERE) == (
        4,
        "4 KV slots of 512 tokens (F16) on the GPU, 64.0 MiB; every expert still on the GPU",
    )
    slots, words = choose_device_slots(free - 1, needs, AUTO, 512, WHERE)
    assert slots == 2 and words.startswith(
        "2 KV slots of 512 tokens (F16) on the GPU, 32.0 MiB; every expert"
    )
    assert words.endswith("; 4 slots would leave the GPU a tier of 1000.0 MiB, not every expert's 1000.0 MiB")
    slots, words = choose_device_slots(_free(needs[2].reserve, every) - 1, needs, AUTO, 512, WHERE)
    assert slots == 1 and words.startswith("4 slots would leave the GPU a tier of ")
    assert "; 2 slots would leave the GPU a tier of " in words


def test_a_tier_keeps_at_least_seven_eighths_of_one_slots():
    needs = _needs(every=10_000 * MiB)  # more than the device holds: a tier with any slots
    one = 800 * MiB
    free = _free(needs[1].reserve, one)
    assert needs[4].reserve - needs[1].reserve == 78 * MiB  # 4 slots: 722 MiB, 2 slots: 774 MiB
    slots, words = choose_device_slots(free, needs, AUTO, 512, WHERE)
    assert (slots, words) == (
        4,
        "4 KV slots of 512 tokens (F16) on the GPU, 64.0 MiB; the GPU tier keeps "
        "722.0 MiB of one slot's 800.0 MiB",
    )
    one = 8 * 78 * MiB - 1  # 4 slots leave a hair under 7/8
    slots, words = choose_device_slots(_free(needs[1].reserve, one), needs, AUTO, 512, WHERE)
    assert slots == 2 and "; 4 slots would leave the GPU tier " in words and "(less than 7/8)" in words
    slots, words = choose_device_slots(_free(needs[1].reserve, 8 * MiB), needs, AUTO, 512, WHERE)
    assert slots == 1 and words.startswith("4 slots would leave the GPU tier 0 B of one slot's 8.0 MiB")
    # the host cache streams: a tier of every expert's bytes at most, whatever the slots
    needs = _needs(holds_all=False)
    slots, words = choose_device_slots(1 << 40, needs, AUTO, 512, WHERE)
    assert slots == 4 and words.endswith("the GPU tier keeps 1000.0 MiB of one slot's 1000.0 MiB")


@pytest.mark.parametrize("tier", [300 * MiB, None])
def test_an_explicit_tier_takes_the_slots_that_fit_beside_it(tier):
    needs = _needs()
    keep = tier or needs[1].every
    beside = "every expert on the GPU" if tier is None else "the GPU tier of 300.0 MiB"
    slots, words = choose_device_slots(_free(needs[4].reserve, keep), needs, tier, 512, WHERE)
    assert (slots, words) == (
        4,
        f"4 KV slots of 512 tokens (F16) on the GPU, 64.0 MiB; they fit beside {beside}",
    )
    slots, words = choose_device_slots(_free(needs[4].reserve, keep) - 1, needs, tier, 512, WHERE)
    assert slots == 2 and words.endswith(
        f"; 4 slots' 64.0 MiB KV cache and 140.0 MiB of graph buffers would not fit on the GPU "
        f"({format_size(_free(needs[4].reserve, keep) - 1)} free) beside {beside}"
    )
    slots, words = choose_device_slots(_free(needs[2].reserve, keep) - 1, needs, tier, 512, WHERE)
    assert slots == 1 and "4 slots' " in words and "; 2 slots' 32.0 MiB KV cache" in words


# --- loads on ggml's CPU backend, its free memory given ----------------------------------------------


@pytest.fixture
def device(tiny_dir, monkeypatch):
    """(the tiny model's path, its DeviceNeeds by slots, the free memory to report: set it)."""
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    free = [1 << 40]
    monkeypatch.setattr(Backend, "memory", lambda self: (free[0], 2 << 40))
    path = str(tiny_dir("qwen3_moe"))
    with moestream.load(path, cache="64MiB", threads=1, gpu_tier="1GiB") as engine:
        r, loaded = engine.runner, engine.loaded
        needs = {
            n: device_needs(r.spec, r.experts, loaded.ctx_size, 1, n, loaded.trunk.nbytes) for n in (1, 2, 4)
        }
    assert needs[1].holds_all and needs[1].reserve < needs[2].reserve < needs[4].reserve
    return path, needs, free


def _load(path: str, **kw):
    return moestream.load(path, cache="64MiB", threads=1, parallel="auto", **kw)


def test_the_auto_tier_picks_four_two_or_one_slots_by_the_free_memory(device):
    path, needs, free = device
    every = needs[1].every
    free[0] = _free(needs[4].reserve, every)
    with _load(path, gpu_tier="auto") as engine:
        assert engine.options.parallel == 4 and len(engine.runner.seqs) == 4 and engine.batch.slots == 4
        line = engine.mode_line()
        assert line.endswith(
            "parallel 4 (auto: 4 KV slots of 256 tokens (F16) on ggml's cpu backend, 256.0 KiB; every expert "
            "still on ggml's cpu backend)"
        )
        # the runner's own choice, from the same numbers: every expert on the device
        assert engine.runner.tiered is None and "--gpu-tier auto: every expert on the device" in line
        assert "KV cache F16 of 256 positions there in each of 4 slots (--parallel 4)" in line
    free[0] -= 1
    with _load(path, gpu_tier="auto") as engine:
        assert engine.options.parallel == 2 and engine.runner.tiered is None
        assert "; 4 slots would leave ggml's cpu backend a tier of " in engine.mode_line()
    free[0] = _free(needs[2].reserve, every) - 1
    with _load(path, gpu_tier="auto") as engine:
        assert engine.options.parallel == 1 and engine.batch is None and engine.runner.tiered is None
        assert engine.mode_line().endswith(f"not every expert's {every // 1024}.0 KiB)")
    # one slot's tier smaller than every expert: the tiny model's slots take more than 1/8 of it
    free[0] = _free(needs[1].reserve, every - 1)
    with _load(path, gpu_tier="auto") as engine:
        assert engine.options.parallel == 1 and "(less than 7/8)" in engine.mode_line()
        tiered = engine.runner.tiered
        assert tiered is not None and sum(p.slots * p.slot_bytes for p in tiered.plans) <= every - 1


def test_an_explicit_tier_picks_the_slots_that_fit_beside_it(device):
    path, needs, free = device
    tier = needs[1].every // 2
    free[0] = _free(needs[4].reserve, tier)
    with _load(path, gpu_tier=tier) as engine:
        assert engine.options.parallel == 4 and engine.runner.tiered is not None
        assert engine.mode_line().endswith(
            "parallel 4 (auto: 4 KV slots of 256 tokens (F16) on ggml's cpu backend, 256.0 KiB; they fit "
            f"beside the GPU tier of {tier // 1024}.0 KiB)"
        )
    free[0] -= 1
    with _load(path, gpu_tier=tier) as engine:
        assert engine.options.parallel == 2 and "; 4 slots' 256.0 KiB KV cache and " in engine.mode_line()
    free[0] = _free(needs[2].reserve, tier) - 1
    with _load(path, gpu_tier=tier) as engine:
        assert engine.options.parallel == 1 and engine.batch is None


def test_a_backend_that_does_not_say_its_memory_gives_one_slot(device, monkeypatch):
    path, needs, _ = device
    with moestream.load(path, cache="64MiB", threads=1, gpu_tier="auto") as engine:  # load's default: one
        assert engine.options.parallel == 1 and engine.mode_line().endswith("parallel 1")
    monkeypatch.setattr(Backend, "memory", lambda self: (0, 0))
    with _load(path, gpu_tier=needs[1].every) as engine:
        assert engine.options.parallel == 1
        assert engine.mode_line().endswith(
            "parallel 1 (auto: ggml's cpu backend does not say its free memory (give -np N))"
        )


def test_the_slots_chosen_decode_two_prompts_together_each_as_alone(device):
    path, needs, free = device
    free[0] = _free(needs[2].reserve, needs[1].every)  # room for 2 slots with every expert, not 4
    with _load(path, gpu_tier="auto") as engine:
        assert engine.options.parallel == 2
        alone = [engine.generate(p, max_tokens=6, ignore_eos=True).tokens for p in PROMPTS]
        rows = engine.batch.decode_rows
        got = engine.generate_batch(PROMPTS, max_tokens=6, ignore_eos=True)
        assert [g.tokens for g in got] == alone and engine.batch.decode_rows - rows == 2 * 5
        # the runner's steps of both rows at once, every logit as each alone's (test_batch_runner's oracle)
        solo = [_alone(engine.runner, p) for p in PROMPTS]
        tokens, logits = _stepped(engine.runner, PROMPTS, [(0, 1)] * STEPS)
        assert tokens == [t for t, _ in solo]
        assert all(torch.equal(a, b) for a, (_, b) in zip(logits, solo))


def test_the_plan_covers_the_device_graphs_of_a_full_prefill_chunk(tmp_path, monkeypatch):
    """`device_needs` counts the graph sets a backend builds: a prompt of DEVICE_CHUNK tokens (one chunk
    on a backend, two of the host's CHUNK) and a decoded token take no more device scratch
    than planned, and the plan at the host's CHUNK would not have held them (a tiny model of 1024
    positions)."""
    from tiny_models import write_tiny

    path = write_tiny("qwen3_moe", tmp_path / "m", max_position_embeddings=1024)
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(path), cache="64MiB", threads=1, trunk="ggml") as engine:
        r, loaded = engine.runner, engine.loaded
        needs = device_needs(r.spec, r.experts, loaded.ctx_size, 1, 1, loaded.trunk.nbytes)
        prompt = [(7 * i) % 200 + 3 for i in range(DEVICE_CHUNK)]
        engine.generate(prompt, max_tokens=4, ignore_eos=True)
        built = sum(gs.arena.nbytes for gs in r._sets.values())
        assert {t for t, *_ in r._sets} >= {1, DEVICE_CHUNK}
        inter = r.experts.graph_types()[r._moe_layers[0]].inter
        host_chunk = planned_bytes(r.spec, loaded.ctx_size, r.experts.num_experts, inter, 1, 1, CHUNK)[1]
        assert host_chunk < built <= needs.graphs
