"""The `edgemem` command and preset configuration: tables that add up, errors a user can act on."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import edgemem
from edgemem.cli import main
from edgemem.errors import ConfigError
from edgemem.models import archs, build, load_config


def test_version_and_help():
    runner = CliRunner()
    assert runner.invoke(main, ["--version"]).output.strip() == f"edgemem, version {edgemem.__version__}"
    help_text = runner.invoke(main, ["--help"]).output
    assert "archs" in help_text


def test_archs_json_lists_every_preset_with_sizes():
    result = CliRunner().invoke(main, ["archs", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["arch"]: r for r in json.loads(result.output)}
    assert sorted(rows) == archs() and {"softmax", "linear", "deltanet", "gated-deltanet"} <= set(rows)
    for name, row in rows.items():
        model = build(name, seed=0)
        assert row["params"] == sum(p.numel() for p in model.parameters())
        config = model.config
        layers = getattr(config, "n_layers", None) or config.encoder_layers + config.decoder_layers
        assert row["layers"] == layers and row["d_model"] == config.d_model
    gdn = rows["gated-deltanet"]
    assert gdn["state_bytes"] == gdn["layers"] * (4 * 64 * 64 + 3 * 256 * 3) * 4  # recurrent + conv state
    assert gdn["state_bytes_per_token"] == 0
    assert rows["softmax"]["state_bytes"] == 0
    assert rows["softmax"]["state_bytes_per_token"] == 2 * 2 * 256 * 4
    led = rows["led"]  # the decoder's KV cache is preallocated; the cross keys/values grow with the input
    assert led["layers"] == 4 and led["state_bytes_per_token"] == 0
    assert led["state_bytes"] == 2 * 2 * 128 * 256 * 4 + 8 and led["state_bytes_per_input_token"] == 2 * 2 * 256 * 4


def test_archs_table_names_every_preset():
    result = CliRunner().invoke(main, ["archs"])
    assert result.exit_code == 0
    for name in archs():
        assert name in result.output


def test_package_import_does_not_pull_torch():
    code = "import sys, edgemem, edgemem.cli; assert 'torch' not in sys.modules and 'onnx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_arch_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown arch 'mamba'; known: aft, aft-local, delta-rnn, deltanet"):
        build("mamba")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(window=4), r"unknown override 'window' for arch deltanet; valid keys: d_model, .*conv_size"),
        (dict(d_model="wide"), r"d_model must be of type int; got 'wide'"),
        (dict(conv_size=2.5), r"conv_size must be of type int"),
        (dict(n_layers=0), r"n_layers must be positive"),
        (dict(num_heads=5), r"d_model \(256\) is not divisible by num_heads \(5\)"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build("deltanet", **overrides)


def test_overrides_reach_the_model():
    config = load_config("gated-deltanet", d_model=128, num_heads=2, conv_size=0, norm_eps=1)
    assert (config.d_model, config.mixer_options, config.norm_eps) == (128, {"num_heads": 2, "conv_size": 0}, 1.0)
    model = build("gated-deltanet", d_model=128, num_heads=2, conv_size=0)
    assert model.blocks[0].mixer.conv is None and model.blocks[0].mixer.head_dim == 64


def test_a_recipe_file_stands_for_a_preset(tmp_path):
    """`--arch path.toml` (the examples in export/) builds like a preset; its stem names the arch."""
    import pathlib

    example = pathlib.Path(__file__).parents[1] / "export" / "titans-mag-orin-nano.toml"
    config = load_config(str(example), n_layers=1)
    assert (config.arch, config.mixer, config.d_model, config.n_layers) == (
        "titans-mag-orin-nano",
        "titans_mag",
        128,
        1,
    )
    assert config.mixer_options["num_heads"] == 2
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nd_model = 64\n[mixr]\ntype = 'linear'\n")
    with pytest.raises(ConfigError, match=r"unknown section\(s\) mixr"):
        load_config(str(bad))
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"))


def test_set_values_are_toml_literals_and_ranges_are_checked():
    from edgemem.config import finite, parse_overrides, positive_int

    assert parse_overrides(["a=64", "b=1e-3", "c=true", "d=[1, 2]", "e=silu", " f =x=y"]) == {
        "a": 64,
        "b": 1e-3,
        "c": True,
        "d": [1, 2],
        "e": "silu",
        "f": "x=y",
    }
    for bad in ("novalue", "=3"):
        with pytest.raises(ConfigError, match="--set expects key=value"):
            parse_overrides([bad])
    assert positive_int(3, "n") == 3
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(ConfigError, match="n must be a positive integer"):
            positive_int(bad, "n")
    assert finite(2, "x", positive=True) == 2.0
    for bad in (float("nan"), float("inf"), "1", None):
        with pytest.raises(ConfigError, match="x must be a finite number"):
            finite(bad, "x")
    with pytest.raises(ConfigError, match="x must be positive"):
        finite(0.0, "x", positive=True)
