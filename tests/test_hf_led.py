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
    """The LED checkpoint exported (generic, ort and trt) with its source record; the transformers model."""
    from edgemem.export import export
    from edgemem.models.source import Source

    directory, reference = led
    with torch.no_grad():
        reference.final_logits_bias[0, reference.config.eos_token_id] += 3.0  # some beams end early
    reference.save_pretrained(directory)
    model = from_hf(directory)
    out = tmp_path_factory.mktemp("led-export") / "out"
    export(model, out, targets=["generic", "ort", "trt"], source=Source.of(model, "hf", path=directory))
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
    assert set(skipped) == {"trt"} and all(c.ok for c in checks)  # verify runs onnxruntime, never the trt target
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
    with pytest.raises(RuntimeConfigError, match="is an encoder-decoder: a stream starts from its input, not empty"):
        stream.reset()
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


# ---------------------------------------------------------------------- backend 'trt' (stand-in device and engines)
@pytest.fixture(scope="module")
def trt_stand_in(exported, tmp_path_factory):
    """A TrtEngine of the LED export on test_trt_runtime's stand-in device (host memory addressed by integers),
    whose "engines" run the export's generic graphs, the encoder's included, at the addresses the runtime binds;
    and the onnxruntime engine of the same export."""
    from test_trt_runtime import HostDevice, OrtGraph, _fake_engines

    from edgemem.manifest import load as load_manifest
    from edgemem.runtime import Engine
    from edgemem.runtime import trt as trt_runtime

    out, _ = exported
    folder = tmp_path_factory.mktemp("led-engines")
    _fake_engines(out, folder, max_batch=4, max_sequence=5)
    info = json.loads((folder / "engines.json").read_text())
    device = HostDevice()
    graphs = {kind: OrtGraph(out / "generic" / f"{kind}.onnx", device) for kind in ("encoder", "step", "prefill")}
    engine = trt_runtime.TrtEngine(out, load_manifest(out), info, graphs, device, chunk_size=512)
    return engine, Engine.load(out, target="generic", threads=1), device


def test_trt_encoder_writes_the_streams_read_only_state_in_place(trt_stand_in, tmp_path):
    """Engine.encode on backend 'trt': the encoder engine writes the cross keys and values into the stream's
    own buffers; the decoder engines bind those as inputs only, at one address on both sides, with no copy
    or allocation per step; logits, state, checkpoints and generation (greedy and 4 beams) equal onnxruntime's."""
    engine, reference, device = trt_stand_in
    length = 11
    ids, mask = np.arange(3, 3 + length), global_rows(length)[3].numpy()
    ours, theirs = engine.encode(ids, mask), reference.encode(ids, mask)
    assert relative(ours.logits, theirs.logits) <= TOLERANCE
    fills = engine.manifest.encoder["fills"]
    encoder_call = engine._graphs["encoder"].calls[-1]
    assert {name: encoder_call[out] for name, out in fills.items()} == ours._encoded.pointers
    blocks, copies, step = len(device.blocks), device.copies, engine._graphs["step"]
    before = len(step.calls)
    for token in (5, 6, 7):
        assert relative(ours.step(token), theirs.step(token)) <= TOLERANCE
    calls = step.calls[before:]
    for name, pointer in ours._encoded.pointers.items():
        assert [c[name] for c in calls] == [pointer] * 3  # the same buffer, whichever side is current
    assert not any(name in c for c in calls for name in fills.values())  # never an output
    assert (len(device.blocks), device.copies) == (blocks, copies)  # nothing allocated or copied per step
    assert relative(ours.prefill([8, 9, 10, 11, 12, 13, 14]), theirs.prefill([8, 9, 10, 11, 12, 13, 14])) <= TOLERANCE
    state = ours.state_dict()
    for name, value in theirs.state_dict().items():
        assert state[name].shape == value.shape and relative(state[name], value) <= TOLERANCE, name
    assert ours.state_bytes == theirs.state_bytes
    ours.save(tmp_path / "trt.safetensors")  # one checkpoint format for both backends
    assert relative(reference.load_stream(tmp_path / "trt.safetensors").step(4), ours.step(4)) <= TOLERANCE
    assert relative(engine.load_stream(tmp_path / "trt.safetensors").step(4), theirs.step(4)) <= TOLERANCE
    for beams in (1, 4):
        fresh = engine.encode(ids, mask)
        assert fresh.generate(max_new_tokens=8, num_beams=beams) == reference.encode(ids, mask).generate(
            max_new_tokens=8, num_beams=beams
        )


def test_forks_share_the_cross_keys_and_values(trt_stand_in):
    """A fork of a decoder stream shares the read-only cross keys and values (on onnxruntime and on 'trt'),
    copies the rest, and continues exactly as the stream; the shared buffers go with the last holder."""
    import weakref

    engine, reference, device = trt_stand_in
    ids = np.arange(3, 16)
    cross = [s.input for s in engine.manifest.state if not s.output]
    stream = reference.encode(ids)
    fork = stream.fork()
    assert all(fork._grown[name] is stream._grown[name] for name in cross)
    assert fork.step(9).tolist() == stream.step(9).tolist()
    ours = engine.encode(ids)
    blocks = set(device.blocks)
    twin = ours.fork()
    assert twin._encoded is ours._encoded
    added = sum(device.blocks[p].size for p in set(device.blocks) - blocks)
    assert added == sum(b.size for p, b in device.blocks.items() if p in _owned(twin))  # its own buffers only
    assert twin.step(9).tolist() == ours.step(9).tolist()
    shared = weakref.ref(ours._encoded)
    pointers = list(ours._encoded.pointers.values())
    del ours
    assert shared() is not None and all(p in device.blocks for p in pointers)  # the twin still reads them
    del twin
    assert shared() is None and not any(p in device.blocks for p in pointers)


def _owned(stream) -> set[int]:
    buffers = stream._buffers
    return {p for pointers in buffers.state.values() for p in pointers} | {buffers.ids, buffers.logits}


def test_batches_take_streams_of_one_input_length(trt_stand_in):
    """step_batch over decoder streams encoded from inputs of one length equals single steps, and the same
    streams batched again copy nothing; streams of different input lengths are refused with one line (both
    backends: one run takes cross keys and values of one shape), and nothing changes."""
    from edgemem.runtime import BatchError

    engine, reference, device = trt_stand_in
    for backend in (engine, reference):
        a, b, c = backend.encode(np.arange(3, 12)), backend.encode(np.arange(20, 29)), backend.encode(np.arange(3, 16))
        twins = [s.fork() for s in (a, b)]
        for tokens in ([4, 5], [6, 7]):
            copies = device.copies
            got = backend.step_batch([a, b], tokens)
            assert relative(got, np.stack([t.step(k) for t, k in zip(twins, tokens)])) <= TOLERANCE
        assert device.copies == copies  # the second batch of the same streams: no copy
        with pytest.raises(BatchError, match=r"^step_batch: these streams were encoded from inputs of 9, 13 tokens"):
            backend.step_batch([a, c], [4, 4])
        assert (a.position, c.position) == (3, 1)


def test_trt_engine_set_needs_the_encoder(exported, tmp_path):
    """An encoder-decoder's engines.json lists the encoder engine beside step and prefill; one missing from
    engines.json, missing on disk or changed since the build is refused with one line before TensorRT loads."""
    import shutil

    from test_trt_runtime import _fake_engines

    from edgemem.runtime import BackendError, Engine

    export = tmp_path / "export"
    shutil.copytree(exported[0], export)
    library = _fake_engines(export, export / "engines", max_sequence=5)
    info = json.loads((export / "engines" / "engines.json").read_text())
    assert set(info["engines"]) == {"encoder", "prefill", "step"} and info["shared"] == "profiles"
    assert {k: (r["file"], r["profile_index"]) for k, r in info["engines"].items()} == {
        "step": ("model.engine", 0),
        "prefill": ("model.engine", 1),
        "encoder": ("encoder.engine", 0),
    }  # the decoder's one engine (two profiles), the encoder's apart
    encoder = info["engines"]["encoder"]
    assert encoder["profile"] == {name: [[1, 1], [4, 64], [4, 64]] for name in ("input_ids", "global_attention_mask")}
    assert [p["op"] for p in encoder["plugins"]] == ["BandedAttention"] * 4 and encoder["in_place"] == []
    for kind in ("step", "prefill"):  # both profiles of the decoder's engine
        assert info["engines"][kind]["profile"]["past_key_values.0.cross_key"] == [
            [1, 2, 1, 8],
            [4, 2, 64, 8],
            [4, 2, 64, 8],
        ]
    (export / "engines" / "encoder.engine").write_bytes(b"changed")
    with pytest.raises(BackendError, match=r"^\S+encoder.engine does not match its sha256 in engines.json"):
        Engine.load(export, backend="trt", plugins=library)
    (export / "engines" / "encoder.engine").unlink()
    with pytest.raises(BackendError, match=r"the encoder engine encoder.engine listed in engines.json is missing"):
        Engine.load(export, backend="trt", plugins=library)
    del info["engines"]["encoder"]
    (export / "engines" / "engines.json").write_text(json.dumps(info))
    with pytest.raises(BackendError, match=r"engines.json lists no encoder engine; rebuild with `edgemem build"):
        Engine.load(export, backend="trt", plugins=library)
    from edgemem.trt_build import build_engines

    with pytest.raises(EdgememError, match=r"^--max-batch 3000000 × past_key_values.0.cross_key of an input of 64 "):
        build_engines(export, max_batch=3_000_000, max_sequence=1, plugins=library, force=True)  # 2**31 elements


def test_real_trt_engines_encode_and_generate_like_onnxruntime(exported, tmp_path):
    """On a GPU: `edgemem build` engines (encoder included) give onnxruntime's logits and beams."""
    import shutil

    from test_trt_runtime import _gpu_reason

    from edgemem.runtime import Engine
    from edgemem.trt_build import build_engines

    reason = _gpu_reason()
    if reason is not None:
        pytest.skip(f"needs TensorRT, cuda-python, a GPU and the plugins: {reason}")
    export = tmp_path / "export"
    shutil.copytree(exported[0], export)
    build_engines(export, max_batch=4, max_sequence=32)
    engine, reference = Engine.load(export, backend="trt"), Engine.load(export, target="generic", threads=1)
    ids, mask = np.arange(3, 16), global_rows(13)[3].numpy()
    ours, theirs = engine.encode(ids, mask), reference.encode(ids, mask)
    assert relative(ours.logits, theirs.logits) <= TOLERANCE
    for token in range(4, 12):
        assert relative(ours.step(token), theirs.step(token)) <= TOLERANCE
    assert ours.fork().generate(max_new_tokens=8, num_beams=4) == theirs.generate(max_new_tokens=8, num_beams=4)
