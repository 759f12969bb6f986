"""Hugging Face LED import: edgemem's encoder-decoder gives transformers'
`LEDForConditionalGeneration` encoder output and decoder logits (any input length, global tokens
anywhere, several windows per layer), step ≡ prefill at any split; bad checkpoints and inputs
fail with one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemem.errors import CacheFullError, ConfigError, EdgememError, ShapeError
from edgemem.models.hf import from_hf

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # fp32, relative to the largest reference value
DECODER_STEPS = 24


def checkpoint(directory: Path, *, seed: int = 0, **options) -> torch.nn.Module:
    """A tiny random LEDForConditionalGeneration saved to `directory`; returns the transformers model.
    Weights are drawn wider than the usual init so attention moves the output visibly; the logits
    bias is random (transformers initialises it to zero)."""
    defaults = dict(
        vocab_size=50,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        attention_window=[4, 8],
        max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=32,
        init_std=0.3,
    )
    torch.manual_seed(seed)
    model = transformers.LEDForConditionalGeneration(transformers.LEDConfig(**{**defaults, **options})).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_()
    model.save_pretrained(directory)
    return model


def global_rows(t: int) -> torch.Tensor:
    """Four sequences' global masks: none; the first token; a middle one; first, middle and last."""
    mask = torch.zeros(4, t, dtype=torch.long)
    mask[1, 0] = 1
    mask[2, t // 2] = 1
    mask[3, [0, t // 2, t - 1]] = 1
    return mask


def relative(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def led(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("led")
    return directory, checkpoint(directory)


@pytest.mark.parametrize("windows, length, split", [([4, 8], 13, 5), ([4, 12], 11, 1), ([8, 8], 3, 24)])
def test_encoder_and_decoder_match_transformers(tmp_path: Path, windows, length, split):
    """Encoder output and 24 decoder steps' logits within 1e-4 of transformers, for inputs whose
    length is not a multiple of the window (transformers pads; edgemem needs no padding), with
    no, one and several global tokens per sequence; the decoder prefills `split` tokens then steps."""
    reference = checkpoint(tmp_path, attention_window=windows)
    model = from_hf(tmp_path)
    ids = torch.randint(3, 50, (4, length), generator=torch.Generator().manual_seed(1))
    mask = global_rows(length)
    decoder_ids = torch.randint(3, 50, (4, DECODER_STEPS), generator=torch.Generator().manual_seed(2))
    decoder_ids[:, 0] = reference.config.decoder_start_token_id
    with torch.no_grad():
        ref = reference(input_ids=ids, global_attention_mask=mask, decoder_input_ids=decoder_ids)
        assert relative(model.encode(ids, mask), ref.encoder_last_hidden_state) <= TOLERANCE
        state = model.start(ids, mask)
        logits, state = model.prefill(decoder_ids[:, :split], state)
        rows = [logits]
        for i in range(split, DECODER_STEPS):
            logits, state = model.step(decoder_ids[:, i], state)
            rows.append(logits[:, None])
    assert relative(torch.cat(rows, 1), ref.logits) <= TOLERANCE
    assert state["position"].tolist() == [DECODER_STEPS] * 4


def test_untied_head(tmp_path: Path):
    """With tie_word_embeddings false the head is lm_head, not the shared embedding (which the
    encoder and decoder still share; a checkpoint where they differ is refused)."""
    reference = checkpoint(tmp_path / "untied", tie_word_embeddings=False)
    with pytest.raises(ConfigError, match="differs from led.shared.weight: LED shares one embedding"):
        from_hf(tmp_path / "untied")
    with torch.no_grad():
        for side in (reference.led.encoder, reference.led.decoder):
            side.embed_tokens.weight.copy_(reference.led.shared.weight)
    reference.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert model.head is not None
    ids, dec = torch.randint(3, 50, (1, 9)), torch.randint(3, 50, (1, 4))
    with torch.no_grad():
        assert relative(model(ids, dec), reference(input_ids=ids, decoder_input_ids=dec).logits) <= TOLERANCE


def test_bad_checkpoints_and_inputs(led, tmp_path: Path):
    """Each: one line naming what was wrong and what is expected."""
    directory, _ = led
    config = json.loads((directory / "config.json").read_text())
    weights = load_file(directory / "model.safetensors")

    def variant(name: str, config_changes: dict, drop: str | None = None):
        target = tmp_path / name
        target.mkdir()
        (target / "config.json").write_text(json.dumps({**config, **config_changes}))
        save_file({k: v for k, v in weights.items() if k != drop}, target / "model.safetensors")
        return target

    with pytest.raises(ConfigError, match="attention_window must be an even int"):
        from_hf(variant("odd", {"attention_window": [3, 8]}))
    with pytest.raises(ConfigError, match="activation_function 'relu' is not supported"):
        from_hf(variant("relu", {"activation_function": "relu"}))
    with pytest.raises(ConfigError, match="lack led.decoder.layers.1.fc1.weight"):
        from_hf(variant("missing", {}, drop="led.decoder.layers.1.fc1.weight"))
    with pytest.raises(ConfigError, match="tensor shape mismatch"):
        from_hf(variant("wide", {"decoder_ffn_dim": 32}))

    model = from_hf(directory)
    with pytest.raises(ShapeError, match="an input of 65 tokens: the encoder takes 1 to 64"):
        model.start(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ShapeError, match="global_attention_mask must be .* shaped like input_ids"):
        model.start(torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    state = model.start(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(CacheFullError, match="max_length=32"):
        model.prefill(torch.zeros(1, 33, dtype=torch.long), state)


@pytest.fixture(scope="module")
def exported(led, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """The LED checkpoint exported (generic and ort) with its source record; the transformers model."""
    from edgemem.export import export
    from edgemem.models.source import Source

    directory, reference = led
    with torch.no_grad():
        reference.final_logits_bias[0, reference.config.eos_token_id] += 3.0  # some beams end early
    reference.save_pretrained(directory)
    model = from_hf(directory)
    out = tmp_path_factory.mktemp("led-export") / "out"
    export(model, out, targets=["generic", "ort"], source=Source.of(model, "hf", path=directory))
    return out, reference


def test_export_runs_on_onnxruntime(exported):
    """encoder.onnx fills the cross keys/values; prefill then steps of the decoder graphs give
    transformers' logits on both targets; the manifest names the kind, the source and the fills."""
    import onnxruntime as ort

    from edgemem.export.verify import rebuild
    from edgemem.manifest import load as load_manifest

    out, reference = exported
    manifest = load_manifest(out)
    assert manifest.kind == "encoder_decoder" and manifest.source["origin"] == "hf"
    cross = [f"{i}.cross_{k}" for i in range(2) for k in ("key", "value")]
    assert manifest.encoder["fills"] == {f"past_key_values.{c}": f"present.{c}" for c in cross}
    assert [s.input for s in manifest.state if not s.output] == list(manifest.encoder["fills"])  # read only
    assert type(rebuild(manifest)).__name__ == "EncoderDecoder"
    length = 13
    ids, mask = torch.randint(3, 50, (4, length), generator=torch.Generator().manual_seed(3)), global_rows(length)
    decoder_ids = torch.randint(3, 50, (4, DECODER_STEPS), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(input_ids=ids, global_attention_mask=mask, decoder_input_ids=decoder_ids).logits.numpy()
    names = [s.input for s in manifest.state if s.output]
    for target in ("generic", "ort"):
        session = {g: ort.InferenceSession(str(out / target / f"{g}.onnx")) for g in ("encoder", "prefill", "step")}
        inputs = {"input_ids": ids.numpy(), "global_attention_mask": mask.numpy()}
        fills = dict(
            zip(manifest.encoder["fills"], session["encoder"].run(list(manifest.encoder["fills"].values()), inputs))
        )
        state = {
            s.input: fills[s.input]
            if s.input in fills
            else np.zeros([4 if d == "batch" else d for d in s.shape], s.dtype)
            for s in manifest.state
        }
        result = session["prefill"].run(None, {"input_ids": decoder_ids[:, :7].numpy(), **state})
        rows = [result[0]]
        for i in range(7, DECODER_STEPS):
            result = session["step"].run(
                None, {"input_ids": decoder_ids[:, i : i + 1].numpy(), **fills, **dict(zip(names, result[1:]))}
            )
            rows.append(result[0])
        assert relative(np.concatenate(rows, 1), expected) <= TOLERANCE, target


def test_encoder_graph_below_and_at_block_boundaries(exported):
    """encoder.onnx's cross keys and values equal transformers' encoder through each decoder layer's
    k/v projections below one block of the window-8 layer (s = 4) and at two blocks (the logits
    test above runs 13 tokens, a multiple of neither block)."""
    import onnxruntime as ort

    out, reference = exported
    session = ort.InferenceSession(str(out / "ort" / "encoder.onnx"))
    names = [f"present.{i}.cross_{k}" for i in range(2) for k in ("key", "value")]
    for length in (3, 8):
        ids, mask = torch.randint(3, 50, (4, length), generator=torch.Generator().manual_seed(6)), global_rows(length)
        got = session.run(names, {"input_ids": ids.numpy(), "global_attention_mask": mask.numpy()})
        with torch.no_grad():
            encoded = reference.get_encoder()(input_ids=ids, global_attention_mask=mask).last_hidden_state
            layers = reference.get_decoder().layers
            expected = [getattr(layer.encoder_attn, f"{k}_proj")(encoded) for layer in layers for k in ("k", "v")]
        for name, g, e in zip(names, got, expected, strict=True):
            assert relative(g, e.unflatten(2, (2, -1)).transpose(1, 2).numpy()) <= TOLERANCE, (name, length)


def test_verify_checks_the_encoder_and_the_decoder(exported):
    """`edgemem verify` rebuilds the model from the source record and checks the encoder graph's fills
    and the decoder graphs from an encoded input, on every target."""
    from edgemem.export.verify import verify

    out, _ = exported
    checks, skipped = verify(out, batch=2, prompt=5, steps=3)
    assert not skipped and all(c.ok for c in checks)
    graphs = {(c.target, c.graph) for c in checks}
    assert {("generic", "encoder"), ("ort", "encoder"), ("ort", "step"), ("ort", "prefill≡step")} <= graphs


def test_checkpoint_keeps_the_kind(led, tmp_path: Path):
    """A checkpoint records its model kind and loads back as that kind, with the same outputs."""
    from edgemem.models import load_checkpoint, save_checkpoint

    model = from_hf(led[0])
    save_checkpoint(model, tmp_path / "led.safetensors")
    again = load_checkpoint(tmp_path / "led.safetensors")
    ids, dec = torch.randint(3, 50, (1, 9)), torch.randint(3, 50, (1, 4))
    with torch.no_grad():
        assert type(again).__name__ == "EncoderDecoder" and torch.equal(again(ids, dec), model(ids, dec))


def test_runtime_generates_as_transformers(exported):
    """Engine.encode + Stream.generate: greedy and 4-beam outputs equal transformers' generate, with
    a global first token and several global tokens (the EOS logit is raised, so some beams end
    early); a fork of a decoder stream continues as the stream does."""
    from edgemem.runtime import Engine

    out, reference = exported
    engine = Engine.load(out)
    length, new = 11, 10
    ids, mask = torch.randint(3, 50, (4, length), generator=torch.Generator().manual_seed(5)), global_rows(length)
    for row in (1, 3):
        options = dict(
            input_ids=ids[row : row + 1], global_attention_mask=mask[row : row + 1], max_new_tokens=new, do_sample=False
        )
        greedy = reference.generate(**options, num_beams=1)[0, 1:].tolist()
        beam = reference.generate(**options, num_beams=4, length_penalty=1.0, early_stopping=True)[0, 1:].tolist()
        stream = engine.encode(ids[row].numpy(), mask[row].numpy())
        fork = stream.fork()
        got = stream.generate(max_new_tokens=new)
        assert got == greedy[: len(got)] and all(t == reference.config.pad_token_id for t in greedy[len(got) :])
        assert fork.generate(max_new_tokens=new) == got
        got = engine.encode(ids[row].numpy(), mask[row].numpy()).generate(max_new_tokens=new, num_beams=4)
        assert got == beam[: len(got)] and all(t == reference.config.pad_token_id for t in beam[len(got) :])


def test_runtime_bad_input(exported, small_exports):
    """One line each, and the stream or engine is unchanged."""
    from edgemem.errors import ConfigError as RuntimeConfigError
    from edgemem.runtime import Engine
    from edgemem.runtime.errors import TokenError

    out, _ = exported
    engine = Engine.load(out)
    with pytest.raises(TokenError, match="an input of 65 tokens: the encoder takes 1 to 64"):
        engine.encode(np.zeros(65, dtype=np.int64))
    with pytest.raises(TokenError, match=r"global_attention_mask must hold one 0 or 1 per input token \(9\)"):
        engine.encode(np.zeros(9, dtype=np.int64), np.zeros(8, dtype=np.int64))
    with pytest.raises(RuntimeConfigError, match="its streams start from an input, engine.encode"):
        engine.new_stream()
    stream = engine.encode(np.arange(3, 12))
    before = stream.state_dict()
    with pytest.raises(RuntimeConfigError, match="num_beams must be an integer >= 1"):
        stream.generate(max_new_tokens=4, num_beams=0)
    assert stream.position == 1 and all(np.array_equal(before[k], v) for k, v in stream.state_dict().items())
    with pytest.raises(RuntimeConfigError, match="is a lm export: encode needs an encoder-decoder"):
        Engine.load(small_exports["linear"]).encode([1, 2, 3])
    from edgemem.runtime import bench

    with pytest.raises(EdgememError, match="is an encoder_decoder export, whose streams start from Engine.encode"):
        bench.run(out, positions=[4], batches=[1])


def test_cli_run_encodes_the_input(exported):
    """`edgemem run` on an encoder-decoder export encodes the given ids and prints the greedy output;
    without an input it says what to give."""
    from click.testing import CliRunner

    from edgemem.cli import main
    from edgemem.runtime import Engine

    out, _ = exported
    ids = list(range(3, 14))
    expected = Engine.load(out).encode(ids).generate(max_new_tokens=6)
    result = CliRunner().invoke(main, ["run", str(out), "--ids", ",".join(map(str, ids)), "--max-new-tokens", "6"])
    assert result.exit_code == 0 and result.stdout.split() == [str(t) for t in expected]
    result = CliRunner().invoke(main, ["run", str(out), "--max-new-tokens", "6"])
    assert result.exit_code == 2 and "is an encoder-decoder: give the input to encode (--prompt TEXT" in result.output
