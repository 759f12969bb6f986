"""The `led` preset (an encoder-decoder) and the sequence-to-sequence task `copy-marked`: the task's
episodes, training and scoring through `edgemem train` / `eval`, the committed checkpoint's score,
and `edgemem run` (greedy, beam search, global tokens) on an encoder-decoder export."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from edgemem.cli import main
from edgemem.errors import ConfigError, EdgememError
from edgemem.models import build, load_checkpoint, load_config, save_checkpoint
from edgemem.tasks import END, MARKER, VALUES, get_task, train_rng
from edgemem.train import evaluate, train

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "checkpoints" / "led-copy-marked.safetensors"
TINY = dict(
    d_model=16,
    encoder_layers=1,
    decoder_layers=1,
    encoder_heads=2,
    decoder_heads=2,
    encoder_ffn=16,
    decoder_ffn=16,
    windows=[2],
    max_encoder_positions=64,
    max_decoder_positions=8,
)


def test_copy_marked_outputs_the_marked_tokens_in_order_then_the_end_token():
    task = get_task("copy-marked", length=20, tokens=3)
    pairs = task.batch(64, 20, np.random.default_rng(0))
    assert pairs.inputs.shape == pairs.global_mask.shape == (64, 20) and pairs.tokens.shape == (64, 4)
    for inputs, mask, tokens, targets in zip(pairs.inputs, pairs.global_mask, pairs.tokens, pairs.targets):
        markers = np.flatnonzero(inputs == MARKER)
        assert len(markers) == 3 and (np.diff(markers) >= 2).all() and markers[-1] < 19  # a token follows each
        assert np.flatnonzero(mask).tolist() == [0]  # the first token is global
        rest = np.delete(inputs, markers)
        assert ((rest >= VALUES[0]) & (rest < VALUES[1])).all()
        assert np.array_equal(targets, [*inputs[markers + 1], END]) and np.array_equal(tokens, [END, *targets[:-1]])
    assert {int(m) for row in pairs.inputs for m in np.flatnonzero(row == MARKER)} >= {0, 17}  # marks reach both ends
    held = task.stream(4, 80, seed=0)
    assert held.inputs.shape == (4, 80) and (held.inputs == MARKER).sum(1).tolist() == [3] * 4  # 4×: as many marks
    assert np.array_equal(held.inputs, task.stream(4, 80, seed=0).inputs)
    assert not np.array_equal(task.stream(4, 20, seed=0).inputs, task.batch(4, 20, train_rng(0)).inputs)
    with pytest.raises(ConfigError, match="copy-marked length must be ≥ 2 × tokens = 8"):
        get_task("copy-marked", length=7, tokens=4)


def test_led_preset_is_an_encoder_decoder_whose_settings_are_checked(tmp_path):
    model = build("led", seed=0, **TINY)
    assert type(model).__name__ == "EncoderDecoder" and model.config.windows == [2]
    assert (model.config.decoder_start_token_id, model.config.eos_token_id) == (END, END)
    for overrides, message in [
        (dict(mlp_hidden=8), r"unknown override 'mlp_hidden' for arch led; valid keys: vocab_size, d_model"),
        (dict(windows=[4]), r"windows lists one window per encoder layer: 2 expected, got \[4\]"),
        (dict(windows=[0, 4]), "windows must be positive"),
        (dict(eos_token_id=256), r"eos_token_id \(256\) must be a token id below vocab_size \(256\)"),
        (dict(d_model="wide"), "d_model must be of type int"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build("led", **overrides)
    recipe = tmp_path / "mine.toml"  # a recipe file of the encoder-decoder kind
    for text, message in [
        (
            'kind = "encoder_decoder"\n[model]\nd_model = 8\n',
            r"recipe mine: \[model\] lacks vocab_size, encoder_layers",
        ),
        (
            'kind = "encoder_decoder"\n[mixer]\ntype = "softmax"\n',
            r"unknown section\(s\) mixer; an encoder-decoder has",
        ),
        ('kind = "seq2seq"\n', "kind 'seq2seq' is not one of lm, encoder_decoder"),
    ]:
        recipe.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(str(recipe))


def test_training_on_copy_marked_round_trips_through_the_checkpoint_and_every_parameter_learns(tmp_path):
    out = tmp_path / "led.safetensors"
    result = train("led", "copy-marked", 3, out, overrides=TINY, batch=8, progress=False)
    assert len(result.losses) == 3 and all(math.isfinite(v) for v in result.losses)
    model = load_checkpoint(out)
    scores = evaluate(out, "copy-marked", 32, batch=4, seed=1)
    assert scores == evaluate(result.model, "copy-marked", 32, batch=4, seed=1)
    assert set(scores) == {"task", "arch", "length", "exact_match", "token_accuracy"} and scores["length"] == 32
    pairs = get_task("copy-marked").batch(4, 24, np.random.default_rng(0))  # global tokens: their projections learn
    inputs, mask, tokens, targets = (
        torch.from_numpy(t) for t in (pairs.inputs, pairs.global_mask, pairs.tokens, pairs.targets)
    )
    torch.nn.functional.cross_entropy(model(inputs, tokens, mask).flatten(0, 1), targets.flatten()).backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    with pytest.raises(ConfigError, match="copy-marked trains an encoder-decoder"):
        train("softmax", "copy-marked", 1, None, overrides=dict(d_model=16, n_layers=1))
    with pytest.raises(ConfigError, match="mqar trains a language model; led is of kind encoder_decoder"):
        train("led", "mqar", 1, None, overrides=TINY)
    with pytest.raises(ConfigError, match="starts and ends its outputs with token 2; led has decoder_start_token_id=1"):
        train("led", "copy-marked", 1, None, overrides={**TINY, "decoder_start_token_id": 1})


def test_a_checkpoint_of_other_layer_counts_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = tmp_path / "led.safetensors"
    save_checkpoint(build("led", seed=0, **{**TINY, "encoder_layers": 2, "windows": [2, 2]}), path)
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    for prefix, message in [
        ("encoder.1.", "its config says encoder_layers=2 but it holds the weights of 1 encoder layer"),
        ("decoder.0.", "its config says decoder_layers=1 but it holds the weights of 0 decoder layers"),
    ]:
        save_file(
            {k: v for k, v in tensors.items() if not k.startswith(prefix)}, tmp_path / "cut.safetensors", metadata
        )
        with pytest.raises(EdgememError, match=f"does not fit its own config: {message}$"):
            load_checkpoint(tmp_path / "cut.safetensors")


def recorded() -> dict[str, float]:
    """The committed checkpoint's scores at the training length, from checkpoints/README.md."""
    row = re.search(
        r"^\| `led-copy-marked\.safetensors` \| led \| copy-marked \| ([\d.]+) \| ([\d.]+) \|",
        (ROOT / "checkpoints" / "README.md").read_text(),
        flags=re.M,
    )
    assert row, "checkpoints/README.md has no led-copy-marked row"
    return {"exact_match": float(row[1]), "token_accuracy": float(row[2])}


def test_committed_led_checkpoint_keeps_its_score():
    """32 of the README's 128 held-out inputs (the same first ones: stream b does not depend on the batch):
    each score may fall at most three binomial standard errors (and one input) below the recorded one."""
    assert CHECKPOINT.stat().st_size < 1_000_000
    model, n = load_checkpoint(CHECKPOINT), 32
    scores = evaluate(model, "copy-marked", batch=n, seed=0)
    for metric, stated in recorded().items():
        floor = stated - 3 * math.sqrt(stated * (1 - stated) / n) - 1 / n
        assert scores[metric] >= floor, (metric, scores[metric], stated)
    pairs = get_task("copy-marked").stream(4, 32, seed=0)  # exact_match's greedy output, decoded again without a cache
    inputs, mask = torch.from_numpy(pairs.inputs), torch.from_numpy(pairs.global_mask)
    out = torch.full((4, 1), END)
    with torch.no_grad():
        for _ in range(pairs.targets.shape[1]):
            out = torch.cat([out, model(inputs, out, mask)[:, -1].argmax(-1, keepdim=True)], 1)
    exact = (out[:, 1:].numpy() == pairs.targets).all(1).mean()
    assert exact == evaluate(model, "copy-marked", batch=4, seed=0)["exact_match"]


def test_cli_run_greedy_and_beam_on_an_encoder_decoder_export(small_exports, tmp_path):
    """`edgemem run` encodes the ids with the --global positions (the saved stream holds the cross keys of
    that encoding) and prints what Engine.encode + generate give, greedy and with 3 beams; --global on a
    decoder-only export, a position past the input and --num-beams with --temperature are one line each."""
    from edgemem.runtime import Engine

    out = small_exports["led"]
    ids = list(range(130, 160))
    mask = np.zeros(len(ids), dtype=np.int64)
    mask[[0, 7, 21]] = 1
    engine = Engine.load(out)
    base = ["run", str(out), "--ids", ",".join(map(str, ids)), "--global", "0,7,21", "--max-new-tokens", "6"]
    result = CliRunner().invoke(main, [*base, "--print-ids", "--save-state", str(tmp_path / "s.safetensors")])
    assert result.exit_code == 0, result.output
    greedy = list(engine.encode(ids, mask).generate(max_new_tokens=6))
    assert result.stdout.split() == [str(t) for t in greedy] and len(greedy) > 1
    saved = engine.load_stream(tmp_path / "s.safetensors").state_dict()
    cross = "past_key_values.0.cross_key"
    assert np.array_equal(saved[cross], engine.encode(ids, mask).state_dict()[cross])
    assert not np.allclose(saved[cross], engine.encode(ids).state_dict()[cross])  # the global tokens count
    beam = engine.encode(ids, mask).generate(max_new_tokens=6, num_beams=3)
    result = CliRunner().invoke(main, [*base, "--print-ids", "--num-beams", "3"])
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == [str(t) for t in beam] and beam != greedy
    for args, message in [
        ([*base[:4], "--global", "30"], "--global: position 30 is not in the input (positions 0 to 29)"),
        ([*base, "--num-beams", "2", "--temperature", "1"], "--num-beams searches deterministically"),
        (["run", str(small_exports["linear"]), "--ids", "1,2", "--global", "0"], "linear has no encoder"),
    ]:
        result = CliRunner().invoke(main, args)
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output
