"""The prefix state cache and speculative decoding (`edgemem.runtime.prefix`, `edgemem.runtime.speculative`).

A stream restored from a cached prefix continues exactly as one that prefilled everything; the cache
stays within its bytes; speculation with prompt lookup or a draft model yields plain greedy's tokens
(two presets, a trained checkpoint, a Qwen3.5 hybrid import with a preallocated KV cache), and its
sampled tokens have the target's distribution (a chi-square test against the exact distribution).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import _sources_key, export_presets

from edgemem.errors import ConfigError
from edgemem.runtime import Engine

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["gated-deltanet", "deltanet", "softmax"]  # the session's small exports; softmax: a growing KV cache
OTHER_VOCABULARY = {"linear": ({"d_model": 16, "mlp_hidden": 16, "n_layers": 1, "vocab_size": 61}, ["ort"])}
CHUNK = 16
TRAINED = {"trained": "deltanet-bytes.safetensors", "trained-draft": "deltanet-bytes-draft.safetensors"}
TEXT = (
    b"def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"  # noqa: E501
    b"def div(a, b):\n    return a / b\n\n\n"
)


def _export_models(root: Path) -> None:
    """The trained byte model of checkpoints/ and its trained draft, and a tiny Qwen3.5 hybrid import (vocabulary
    256) with a KV cache exactly as long as the speculation test needs, for onnxruntime, into `root`."""
    from test_hf_qwen3_5 import randomise, save, text_config
    from transformers import Qwen3_5ForCausalLM

    from edgemem.export import export
    from edgemem.models import from_hf, load_checkpoint
    from edgemem.models.lm import set_kv_cache

    for name, file in TRAINED.items():
        export(load_checkpoint(ROOT / "checkpoints" / file), root / name, targets=["ort"])
    config = text_config(["linear_attention", "full_attention"])
    config.vocab_size = 256
    hybrid = from_hf(save(randomise(Qwen3_5ForCausalLM(config), seed=3), root / "hf"))
    set_kv_cache(hybrid, len(TEXT) + 40 + 48)  # speculation runs up to the last slot
    export(hybrid, root / "hybrid", targets=["ort"])
    (root / "complete").touch()


@pytest.fixture(scope="module")
def exports(request, tmp_path_factory, small_exports) -> dict[str, Path]:
    """Three presets of `small_exports`, one of another vocabulary, the trained model and the hybrid
    (`_export_models`), cached across runs like `small_exports`."""
    found = {a: small_exports[a] for a in PRESETS}
    found.update(export_presets(request, tmp_path_factory, "spec-exports", OTHER_VOCABULARY))
    cache = getattr(request.config, "cache", None)
    root = (
        tmp_path_factory.mktemp("spec")
        if cache is None
        else cache.mkdir("edgemem-spec-models")
        / _sources_key("spec-models", TEXT, *((ROOT / "checkpoints" / f).stat().st_size for f in TRAINED.values()))
    )
    if not (root / "complete").is_file():
        _export_models(root)
    return {**found, **{name: root / name for name in TRAINED}, "hybrid": root / "hybrid"}


def _load(exports, name, **options) -> Engine:
    return Engine.load(exports[name], threads=1, chunk_size=CHUNK, **options)


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(np.asarray(b, np.float64)).max())


# ---------------------------------------------------------------------- prefix cache
@pytest.mark.parametrize("name", ["gated-deltanet", "hybrid", "softmax"])
def test_a_stream_restored_from_a_cached_prefix_continues_as_an_uncached_one(exports, name):
    cached, plain = _load(exports, name, prefix_cache_bytes=1 << 22), _load(exports, name)
    rng = np.random.default_rng(0)
    first = rng.integers(0, 256, 100)
    second = np.concatenate([first[:90], rng.integers(0, 256, 11)])  # shares 90 tokens: chunk boundary 80
    cached.new_stream().prefill(first, all_logits=False)
    assert (cached.prefix_cache.hits, len(cached.prefix_cache)) == (0, 7)  # 6 chunks and the prompt's end
    restored, reference = cached.new_stream(), plain.new_stream()
    assert _rel(restored.prefill(second, all_logits=False), reference.prefill(second, all_logits=False)) <= 1e-4
    assert (cached.prefix_cache.hits, cached.prefix_cache.tokens_reused) == (1, 80)
    for token in rng.integers(0, 256, 5).tolist():
        assert _rel(restored.step(token), reference.step(token)) <= 1e-4
    assert (
        _rel(
            restored.state_dict()[cached.manifest.state[0].input],
            reference.state_dict()[cached.manifest.state[0].input],
        )
        <= 1e-4
    )
    again = cached.new_stream()  # the whole prompt is cached: nothing runs
    assert _rel(again.prefill(first, all_logits=False), plain.new_stream().prefill(first, all_logits=False)) <= 1e-4
    assert again.position == 100 and cached.prefix_cache.tokens_reused == 180


def test_only_a_fresh_stream_uses_the_cache_and_all_logits_prefills_only_fill_it(exports):
    engine, plain = _load(exports, "gated-deltanet", prefix_cache_bytes=1 << 22), _load(exports, "gated-deltanet")
    ids = np.random.default_rng(1).integers(0, 256, 40)
    engine.new_stream().prefill(ids)  # all logits: fills the cache, cannot restore (no logits for skipped tokens)
    assert engine.prefix_cache.misses == engine.prefix_cache.hits == 0 and len(engine.prefix_cache) == 3
    other = engine.stream_from_state(plain.new_stream().state_dict())  # position 0 but not made fresh: not looked up
    other.prefill(ids, all_logits=False)
    assert engine.prefix_cache.hits == 0
    stream = engine.new_stream()
    stream.step(3)
    stream.reset()  # fresh again
    expected = plain.new_stream().prefill(ids, all_logits=False)
    assert _rel(stream.prefill(ids, all_logits=False), expected) <= 1e-4 and engine.prefix_cache.hits == 1


def test_the_cache_never_holds_more_than_its_bytes(exports):
    probe = _load(exports, "hybrid")
    snapshot = probe.snapshot_bytes(CHUNK)  # the hybrid's snapshots grow with the filled part of its KV cache
    engine = _load(exports, "hybrid", prefix_cache_bytes=int(3.5 * snapshot))
    cache = engine.prefix_cache
    rng = np.random.default_rng(2)
    for _ in range(6):
        engine.new_stream().prefill(rng.integers(0, 256, 2 * CHUNK), all_logits=False)
        assert cache.bytes <= cache.capacity
        assert cache.bytes == sum(s.nbytes for s in cache._entries.values())
    assert len(cache) >= 2 and cache.misses == 6
    assert all(s.tokens.size == 2 * CHUNK for s in list(cache._entries.values())[-1:])  # the newest kept


def test_a_cache_smaller_than_one_snapshot_is_refused(exports):
    need = _load(exports, "gated-deltanet").snapshot_bytes(1)
    with pytest.raises(ConfigError) as e:
        _load(exports, "gated-deltanet", prefix_cache_bytes=need - 1)
    assert "smaller than one snapshot" in str(e.value) and f"{need} bytes" in str(e.value) and "\n" not in str(e.value)
    assert _load(exports, "gated-deltanet", prefix_cache_bytes=need).prefix_cache.capacity == need


# ---------------------------------------------------------------------- speculative decoding
CASES = [
    ("gated-deltanet", "deltanet"),
    ("deltanet", "gated-deltanet"),
    ("trained", "deltanet"),
    ("trained", "trained-draft"),
    ("hybrid", "deltanet"),
    ("softmax", "gated-deltanet"),
]


@pytest.mark.parametrize(("name", "draft_name"), CASES)
def test_greedy_speculation_yields_plain_greedy_tokens(exports, name, draft_name):
    target, draft = _load(exports, name), _load(exports, draft_name)
    prompt = TEXT + TEXT[:40]  # repetitive: prompt lookup finds continuations, some of them wrong
    expected = target.new_stream().generate(prompt, 48)
    looked = target.new_stream()
    assert looked.generate(prompt, 48, draft="prompt-lookup", draft_tokens=4) == expected
    assert looked.position == len(prompt) + 48 and looked.generation.tokens == 48
    drafted = target.new_stream()
    assert drafted.generate(prompt, 48, draft=draft, draft_tokens=3) == expected
    stats = drafted.generation
    assert stats.verify_runs > 0 and stats.drafted > 0
    assert stats.accepted + looked.generation.accepted < stats.drafted + looked.generation.drafted  # rollbacks ran
    reference = target.new_stream()
    reference.generate(prompt, 48)
    assert _rel(drafted.logits, reference.logits) <= 1e-4  # the state after speculation is the plain one
    if name == "trained":
        assert looked.generation.accepted > 0  # a trained model continues some of a repeated text as it was
    if draft_name == "trained-draft":
        assert stats.accepted > 0  # a draft trained on the same bytes agrees with the target on some tokens
    itself = target.new_stream()  # a draft equal to the target: every draft accepted, no rollback
    assert itself.generate(prompt, 48, draft=target, draft_tokens=5) == expected
    assert itself.generation.accepted == itself.generation.drafted > 0


def _sequence_probabilities(engine, prompt, top_k, n) -> dict[tuple[int, ...], float]:
    """The exact probability of every n-token continuation at temperature 1 with top-k (stepping the target)."""
    from edgemem.runtime.sampling import distribution

    out: dict[tuple[int, ...], float] = {}
    base = engine.new_stream()
    logits = base.prefill(prompt, all_logits=False)

    def walk(stream, logits, prefix, p):
        if len(prefix) == n:
            out[prefix] = p
            return
        probs = distribution(logits, 1.0, top_k)
        for token in np.flatnonzero(probs):
            child = stream.fork()
            walk(child, child.step(int(token)), (*prefix, int(token)), p * probs[token])

    walk(base, logits, (), 1.0)
    return out


def _chi_square_quantile(df: int, z: float = 3.09) -> float:
    """The 0.999 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, outcomes expected fewer than 5 times pooled into one bin
    (the chi-square approximation needs expected counts of about 5 or more)."""
    rare = [k for k, p in expected.items() if n * p < 5]
    bins = [(counts.get(k, 0), n * p) for k, p in expected.items() if k not in rare]
    if rare:
        bins.append((sum(counts.get(k, 0) for k in rare), n * sum(expected[k] for k in rare)))
    return sum((seen - want) ** 2 / want for seen, want in bins), len(bins) - 1


def test_sampled_speculation_has_the_targets_distribution(exports):
    """Three tokens at top-k 3 from the trained model after a repeated text: 27 outcomes with exact
    probabilities; 600 speculative samples (fixed seeds) per drafter pass a chi-square test at 0.1 %; the
    draft model's own samples (the control) fail it. (The prompt comes from the prefix cache.)"""
    target, draft = _load(exports, "trained", prefix_cache_bytes=1 << 20), _load(exports, "deltanet")
    prompt = TEXT + TEXT[:20]  # ends in "\n    r": prompt lookup proposes "eturn", often what the model expects
    exact = _sequence_probabilities(target, prompt, top_k=3, n=3)
    assert len(exact) == 27 and abs(sum(exact.values()) - 1) < 1e-9
    n = 600
    for drafter in ("prompt-lookup", draft):
        counts: dict = {}
        accepted = 0
        for seed in range(n):
            stream = target.new_stream()
            out = tuple(stream.generate(prompt, 3, temperature=1.0, top_k=3, seed=seed, draft=drafter, draft_tokens=2))
            counts[out] = counts.get(out, 0) + 1
            accepted += stream.generation.accepted
        stat, df = _chi_square(counts, exact, n)
        assert stat < _chi_square_quantile(df), (drafter, stat, df)
        if drafter == "prompt-lookup":
            assert accepted > 0
    control = _sequence_probabilities(draft, prompt, top_k=3, n=3)
    rng = np.random.default_rng(0)
    keys = list(control)
    drawn = rng.choice(len(keys), size=n, p=np.array([control[k] for k in keys]))
    counts = {}
    for i in drawn:
        counts[keys[i]] = counts.get(keys[i], 0) + 1
    stat, df = _chi_square(counts, exact, n)
    assert stat > _chi_square_quantile(df)  # the test tells the draft's distribution from the target's


def test_bad_drafts_are_one_line_errors(exports):
    target = _load(exports, "gated-deltanet")
    stream = target.new_stream()
    with pytest.raises(ConfigError, match=r"^draft_tokens must be a positive integer .*got 0$"):
        stream.generate(b"ab", 4, draft="prompt-lookup", draft_tokens=0)
    with pytest.raises(ConfigError, match="must be None, \"prompt-lookup\" or an Engine; got 'lookup'"):
        stream.generate(b"ab", 4, draft="lookup")
    with pytest.raises(ConfigError) as e:
        stream.generate(b"ab", 4, draft=_load(exports, "linear"))
    assert str(e.value) == (
        "the draft model's vocabulary (linear, 61 tokens) is not the target's (gated-deltanet, 256): "
        "a draft must share the vocabulary"
    )
    assert stream.position == 0  # refused before anything ran


# ---------------------------------------------------------------------- CLI and Triton
def test_cli_run_with_a_draft_prints_plain_greedy_text_and_the_acceptance(exports):
    from click.testing import CliRunner

    from edgemem.cli import main

    runner = CliRunner()
    base = [
        "run",
        str(exports["trained"]),
        "--prompt",
        (TEXT + TEXT[:20]).decode(),
        "--max-new-tokens",
        "24",
        "--threads",
        "1",
    ]
    plain = runner.invoke(main, base)
    assert plain.exit_code == 0, plain.output
    for draft in ("prompt-lookup", str(exports["deltanet"])):
        result = runner.invoke(main, [*base, "--draft", draft, "--draft-tokens", "3", "--prefix-cache", "1000000"])
        assert result.exit_code == 0, result.output
        assert result.stdout == plain.stdout
        assert "draft acceptance" in result.stderr
    for args, message in [
        (["--draft", "prompt-lookup", "--draft-tokens", "0"], "--draft-tokens must be at least 1; got 0"),
        (["--prefix-cache", "10"], "--prefix-cache=10 is smaller than one snapshot"),
        (["--draft", "nowhere"], "--draft nowhere: neither prompt-lookup nor an export directory"),
    ]:
        result = runner.invoke(main, [*base, *args])
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output, result.output


def test_triton_sequences_that_start_with_the_same_prompt_share_its_state(exports, tmp_path):
    from edgemem.serve.sequences import Sequences

    engine, plain = _load(exports, "hybrid", prefix_cache_bytes=1 << 22), _load(exports, "hybrid")
    sequences = Sequences(engine, tmp_path / "checkpoints")
    prompt = np.frombuffer(TEXT[:64], dtype=np.uint8).astype(np.int64)
    sequences.run(1, prompt, start=True)
    logits, position = sequences.run(2, prompt, start=True)
    assert position == 64 and engine.prefix_cache.hits == 1 and engine.prefix_cache.tokens_reused == 64
    assert _rel(logits, plain.new_stream().prefill(prompt, all_logits=False)) <= 1e-4


def test_triton_repository_carries_the_prefix_cache_and_refuses_one_too_small(exports, tmp_path):
    from edgemem.serve.repository import write_repository

    repo = write_repository(exports["gated-deltanet"], tmp_path / "repo", name="m", prefix_cache_bytes=1 << 20)
    assert (
        'key: "prefix_cache_bytes" value { string_value: "1048576" }' in (repo.path / "m" / "config.pbtxt").read_text()
    )
    with pytest.raises(ConfigError, match="smaller than one snapshot"):
        write_repository(exports["gated-deltanet"], tmp_path / "small", name="m", prefix_cache_bytes=10)
    assert not (tmp_path / "small").exists()
