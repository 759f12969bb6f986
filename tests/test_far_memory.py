"""The `mqar-far` task, the memory ablation (`without_memory`, `edgemem eval --no-memory`) and the
Titans checkpoints that recall beyond their attention window."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from edgemem.cli import main
from edgemem.errors import ConfigError
from edgemem.layers.titans import NeuralMemoryLayer
from edgemem.models import build, load_checkpoint
from edgemem.tasks import KEYS, VALUES, get_task, train_rng
from edgemem.train import evaluate, without_memory

torch.set_num_threads(2)
ROOT = Path(__file__).resolve().parents[1]
TINY = {"d_model": 32, "n_layers": 2, "mlp_hidden": 32, "num_heads": 2, "chunk_size": 4}


def test_mqar_far_queries_come_after_the_gap_and_ask_the_values_paired_before_it():
    task = get_task("mqar-far", pairs=5, gap=20)
    assert (task.name, task.metric, task.length) == ("mqar-far", "accuracy", 35)
    sample = task.batch(32, 35, np.random.default_rng(0))
    assert sample.tokens.shape == sample.targets.shape == (32, 35) and sample.tokens.dtype == np.int64
    for tokens, targets in zip(sample.tokens, sample.targets):
        keys, values = tokens[0:10:2], tokens[1:10:2]
        assert len(set(keys.tolist())) == 5 and ((keys >= KEYS[0]) & (keys < KEYS[1])).all()
        assert ((values >= VALUES[0]) & (values < VALUES[1])).all()
        assert (tokens[10:30] == 0).all() and (targets[:30] == -1).all()  # the gap: filler, nothing scored
        assert sorted(tokens[30:].tolist()) == sorted(keys.tolist())  # every key asked once, after the gap
        for position in range(30, 35):
            (pair,) = np.flatnonzero(keys == tokens[position])
            assert targets[position] == values[pair]
            assert position - (2 * pair + 1) >= 21  # gap + 1 tokens or more after its value
    orders = {tuple(t[30:]) for t in sample.tokens - sample.tokens[:, :1]}
    assert len(orders) > 1  # queries are not always in the pairs' order


def test_mqar_far_data_is_reproducible_and_held_out_streams_are_not_training_data():
    task = get_task("mqar-far", pairs=4, gap=8)
    first = task.batch(16, 20, train_rng(3))
    assert np.array_equal(first.tokens, task.batch(16, 20, train_rng(3)).tokens)
    assert not np.array_equal(first.tokens, task.batch(16, 20, train_rng(4)).tokens)
    held = task.stream(16, 20, seed=0)
    assert np.array_equal(held.tokens, task.stream(16, 20, seed=0).tokens)
    assert np.array_equal(held.targets, task.stream(16, 20, seed=0).targets)
    assert not np.array_equal(held.tokens, task.stream(16, 20, seed=1).tokens)
    assert not np.array_equal(held.tokens, task.batch(16, 20, train_rng(0)).tokens)
    long = task.stream(4, 80, seed=0)  # 4×: four episodes in a row, the first the held-out one
    assert np.array_equal(long.tokens[:, :20], held.tokens[:4])
    assert ((long.targets >= 0).reshape(4, 4, 20).sum(-1) == 4).all()


@pytest.mark.parametrize(
    "params,length,message",
    [
        ({"pairs": 0}, None, "pairs must be in 1..64"),
        ({"gap": -1}, None, "gap must be ≥ 0"),
        ({"gap": "8"}, None, "integer"),
        ({"pairs": 4, "gap": 8}, 21, "is 20 tokens"),
    ],
)
def test_mqar_far_rejects_bad_parameters(params, length, message):
    with pytest.raises(ConfigError, match=message):
        get_task("mqar-far", **params).batch(1, length, np.random.default_rng(0))


def memory_states(state: dict) -> dict:
    return {k: v for k, v in state.items() if re.search(r"(^|\.)(memory|momentum|chunk_memory)\.\d+$", k)}


@pytest.mark.parametrize(
    "arch,options", [("titans-mag", {"window": 4}), ("titans-mac", {}), ("titans-mal", {"window": 4})]
)
def test_without_memory_leaves_every_memory_at_its_initial_weights(arch, options):
    model = build(arch, seed=1, **TINY, **options).eval()
    tokens = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    initial = memory_states(model.init_state(2))
    assert len(initial) == 2 * 3 * 2  # 2 layers × (memory, momentum, chunk memory) × depth 2
    with torch.no_grad():
        _, learned = model.prefill(tokens, model.init_state(2))
        assert all(not torch.equal(learned[k], initial[k]) for k in initial)  # the memory learned from the tokens
        assert without_memory(model) is model
        logits, frozen = model.prefill(tokens, model.init_state(2))
    for key, value in memory_states(frozen).items():
        torch.testing.assert_close(value, initial[key], rtol=0, atol=0)  # M_t = M_0, momentum 0: no writes at all
    assert torch.isfinite(logits).all()
    for layer in (m for m in model.modules() if isinstance(m, NeuralMemoryLayer)):
        gates = torch.sigmoid(layer.theta(torch.randn(3, TINY["d_model"])))
        assert (gates == 0).all() and (torch.sigmoid(layer.alpha(torch.randn(3, TINY["d_model"]))) == 0).all()


def test_without_memory_needs_a_model_with_a_neural_memory():
    with pytest.raises(ConfigError, match="deltanet model has no neural memory"):
        without_memory(build("deltanet", d_model=32, n_layers=1, mlp_hidden=32, num_heads=2))


def far_rows() -> list[tuple]:
    """(file, arch, window, pairs, gap, (nearest, furthest distance), accuracy with memory, without)
    from checkpoints/README.md."""
    rows = re.findall(
        r"^\| `(\S+-far\.safetensors)` \| (\S+) \| mqar-far \| (\d+) \| (\d+) \| (\d+) \| (\d+)–(\d+) \| ([\d.]+) \| ([\d.]+) \|",  # noqa: E501
        (ROOT / "checkpoints" / "README.md").read_text(),
        flags=re.M,
    )
    return [
        (f, a, int(w), int(p), int(g), (int(d0), int(d1)), float(x), float(y)) for f, a, w, p, g, d0, d1, x, y in rows
    ]


def test_the_readme_lists_a_far_checkpoint_for_mag_and_mac():
    assert sorted(arch for _, arch, *_ in far_rows()) == ["titans-mac", "titans-mag"]


@pytest.mark.parametrize("name,arch,window,pairs,gap,distance,stated,stated_off", far_rows())
def test_far_checkpoint_answers_beyond_its_window_only_through_its_memory(
    name, arch, window, pairs, gap, distance, stated, stated_off
):
    path = ROOT / "checkpoints" / name
    model, task = load_checkpoint(path), get_task("mqar-far", pairs=pairs, gap=gap)
    mixer = model.config.mixer_options
    assert model.config.arch == arch and window == mixer.get("window", mixer["chunk_size"])
    sample = task.stream(128, task.length, seed=0)
    back = [
        q - 1 - 2 * list(t[0 : 2 * pairs : 2]).index(t[q])
        for t in sample.tokens
        for q in range(2 * pairs + gap, len(t))
    ]
    assert (min(back), max(back)) == distance  # tokens from each answer (the value) to its query
    assert distance[0] > model.config.n_layers * window  # further back than two stacked windows reach
    assert evaluate(model, task, batch=128, seed=0)["accuracy"] == pytest.approx(stated, abs=0.005)
    off = without_memory(load_checkpoint(path))
    assert evaluate(off, task, batch=128, seed=0)["accuracy"] == pytest.approx(stated_off, abs=0.005)
    # without memory the answers cannot be reached: the logits at the queries ignore which pairs were given
    tokens = sample.tokens[:8]
    swapped = tokens.copy()
    swapped[:, : 2 * pairs] = task.stream(8, task.length, seed=1).tokens[:, : 2 * pairs]
    with torch.no_grad():
        a, b = (off(torch.from_numpy(t))[:, -pairs:] for t in (tokens, swapped))
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        a, b = (model(torch.from_numpy(t))[:, -pairs:] for t in (tokens, swapped))
        assert (a - b).abs().max() > 1  # with memory they do depend on the pairs


def test_cli_eval_no_memory_turns_the_memory_off(tmp_path):
    out = tmp_path / "m.safetensors"
    args = [
        "train",
        "--arch",
        "titans-mag",
        "--task",
        "mqar-far",
        "--steps",
        "2",
        "--batch",
        "4",
        "--out",
        str(out),
        "--task-set",
        "pairs=2",
        "--task-set",
        "gap=4",
        "--set",
        "window=2",
    ]
    for key, value in TINY.items():
        args += ["--set", f"{key}={value}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    common = [
        "eval",
        "--checkpoint",
        str(out),
        "--task",
        "mqar-far",
        "--task-set",
        "pairs=2",
        "--task-set",
        "gap=4",
        "--batch",
        "16",
        "--json",
    ]
    rows = {}
    for flag in ([], ["--no-memory"]):
        result = CliRunner().invoke(main, common + flag)
        assert result.exit_code == 0, result.output
        rows[bool(flag)] = json.loads(result.output)
    assert [r["length"] for r in rows[True]] == [10, 40]
    off = without_memory(load_checkpoint(out))
    assert (
        rows[True][0]["accuracy"] == evaluate(off, "mqar-far", batch=16, task_params={"pairs": 2, "gap": 4})["accuracy"]
    )
    assert (
        rows[False][0]["accuracy"]
        == evaluate(out, "mqar-far", batch=16, task_params={"pairs": 2, "gap": 4})["accuracy"]
    )
    result = CliRunner().invoke(
        main,
        [
            "eval",
            "--checkpoint",
            str(ROOT / "checkpoints" / "deltanet-mqar.safetensors"),
            "--task",
            "mqar",
            "--no-memory",
        ],
    )
    assert result.exit_code != 0 and "has no neural memory" in result.output and "Traceback" not in result.output
