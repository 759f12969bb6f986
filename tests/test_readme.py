"""Every command and Python block of the READMEs runs as written, on a copy of the repository.

The shell commands (indented and ```sh blocks, one logical line each, `&&` chains split) and the
Python blocks of each README are taken from the text and run in order in a temporary copy, so a
later command sees what an earlier one wrote, as a reader's shell would. A shell command runs only
through `COMMANDS`, a reviewed table keyed by the command's exact text: as written, with the listed
replacements and extra options (small sizes, few steps), checked against its `--help` (a synopsis, or
what needs hardware or hours), or checked equal to `.ci/run`. A command missing from the table fails,
so a new README command cannot go untested; a table entry no README has any more fails too. Python
blocks run verbatim, in one namespace per README; `PYTHON` lists the ones that need hardware and the
error they must give here instead. TOML blocks are loaded as the recipe they show.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from edgemem.cli import main
from edgemem.errors import EdgememError
from edgemem.models import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "samples/README.md",
    "samples/triton-server/README.md",
    "export/README.md",
    "calib/README.md",
    "checkpoints/README.md",
    "benchmarks/README.md",
]
SMALL = "--set d_model=32 --set n_layers=1 --set mlp_hidden=32"


@dataclass(frozen=True)
class Run:
    """Run the command with `replace` ({old: new}, each old must occur) applied and `add` appended."""

    replace: dict = field(default_factory=dict)
    add: str = ""
    why: str = ""


@dataclass(frozen=True)
class Help:
    """Not run (`why`): `--help` of the same program must list every option the line names; `instance`,
    when given, is a concrete form of the line that is run."""

    why: str
    instance: str = ""


@dataclass(frozen=True)
class Background(Run):
    """Started in the background and stopped (SIGTERM, exit code 0) after the last command of its block."""


@dataclass(frozen=True)
class Elsewhere:
    """Not run here: the test `test` (tests/FILE.py::NAME) builds and runs it; that test must exist and name
    the program (`program`)."""

    test: str
    program: str


@dataclass(frozen=True)
class SetUp:
    """A set-up step of the README's two commands: one of `.ci/run`'s steps, or an editable install of extras
    that `pyproject.toml` defines."""


@dataclass(frozen=True)
class SameAsCI:
    """The whole line equals `.ci/run`'s command (its `-q` flags aside)."""


@dataclass(frozen=True)
class Pinned:
    """A pip install of pinned versions: each must be the installed one and allowed by the extra `extra`."""

    extra: str


NATIVE = (
    "tests/test_native_runtime.py::test_the_sample_app_builds_on_the_installed_package_and_generates_what_python_does"
)
GPU = "needs an NVIDIA GPU and TensorRT; tests/test_trt_runtime.py runs it where one is present"
COMMANDS: dict[str, object] = {
    # README.md: the two commands
    "python3 -m venv .venv": SetUp(),
    ". .venv/bin/activate": SetUp(),
    "pip install torch==2.13.0": SetUp(),
    "pip install -e '.[export]'": SetUp(),
    "edgemem export --arch titans-mag --out out/titans-mag --force": Run(add=SMALL),
    "edgemem verify out/titans-mag": Run(),
    "python3 -m venv .venv && . .venv/bin/activate && pip install --no-compile torch==2.13.0 && "
    "pip install --no-compile -e '.[dev]' && bash .ci/debian && "
    'python -m pytest -q -n 2 --dist loadfile -m "not slow" && python -m pytest -q -n 2 --dist loadfile -m slow': SameAsCI(),  # noqa: E501
    # README.md: export
    "edgemem export --arch A --out DIR [--target generic,ort,onnx27,trt] [--seed N] [--checkpoint PATH] "
    "[--set key=value]... [--dtype fp32|fp16|bf16] [--force] [--max-length N [--sinks S]]": Help(
        "a synopsis; the exports below run it"
    ),
    "edgemem verify DIR": Help("a synopsis; the verifications below run it"),
    # README.md: runtime
    "edgemem export --arch gated-deltanet --out out/gdn": Run(add=SMALL),
    "edgemem run DIR --prompt TEXT | --ids 1,2,3 | --ids-file F [--print-ids] [--max-new-tokens N] [--load-state P] "
    "[--save-state P] [--temperature T [--top-k K] [--top-p P]] [--seed S] [--threads N] "
    "[--draft prompt-lookup|DIR [--draft-tokens K]] [--prefix-cache BYTES] [--num-beams N] [--global 0,5,9]": Help(
        "a synopsis",
        instance="edgemem run out/gdn --ids 1,2,3 --print-ids --max-new-tokens 4 --save-state r.safetensors "
        "--temperature 0.8 --top-k 5 --top-p 0.9 --seed 1 --threads 1 --draft prompt-lookup "
        "--draft-tokens 2 --prefix-cache 1000000",
    ),
    "edgemem bench DIR [--positions 1000,10000] [--batch 1,8,64] [--threads 1] [--json F] [--plot F.png]": Help(
        "a synopsis", instance="edgemem bench out/gdn --positions 8 --batch 1,2 --threads 1 --json b.json --no-eager"
    ),
    # README.md: the native runtime (built, installed and run by its own test, with the sanitizers on)
    "cmake -S native -B build/native": Elsewhere(NATIVE, 'samples" / "native'),
    "cmake --build build/native": Elsewhere(NATIVE, "--build"),
    "cmake --install build/native --prefix $HOME/.local/edgemem": Elsewhere(NATIVE, "--install"),
    "cmake -S samples/native -B build/sample -DCMAKE_PREFIX_PATH=$HOME/.local/edgemem": Elsewhere(
        NATIVE, "CMAKE_PREFIX_PATH"
    ),
    "cmake --build build/sample": Elsewhere(NATIVE, "--build"),
    "build/sample/generate out/gdn s.safetensors 72 101 108 108 111 --tokens 16": Elsewhere(NATIVE, "--tokens"),
    # README.md: your own model (path/to/model is a tiny Qwen3.5 with a tokenizer, made by the test)
    "edgemem export --hf path/to/model --out out/mine [--target generic,ort,trt] "
    "[--dtype fp32|fp16|bf16] [--force]": Help(
        "a synopsis", instance="edgemem export --hf path/to/model --out out/mine --target generic,ort"
    ),
    "edgemem verify out/mine": Run(),
    'edgemem run out/mine --prompt "Once upon a time" --max-new-tokens 32': Run(),
    # README.md: quantization, training, TensorRT, serving
    "edgemem calibrate DIR --method dynamic|static|int4 [--block-size 32] [--embeddings int4|fp32] "
    "[--recipe NAME|FILE.toml] [--out QDIR] [--force] [--report F.json] [--plot F.png] [--no-drift] [--threads 1]": Help(  # noqa: E501
        "a synopsis",
        instance="edgemem calibrate out/gdn --method int4 --block-size 16 --embeddings int4 "
        "--out out/gdn-q4 --report q4.json --no-drift --threads 1",
    ),
    "edgemem train --arch A | --init F.safetensors --task mqar|mqar-far|copy|copy-marked|bytes [--steps N] "
    "[--out F.safetensors] "
    "[--set key=value]... [--task-set key=value]... [--seed S] [--batch 64] [--lr 3e-3] [--threads 1] [--device cpu]": Help(  # noqa: E501
        "a synopsis",
        instance=f"edgemem train --arch softmax --task mqar --steps 2 --out t.safetensors {SMALL} "
        "--task-set pairs=4 --seed 1 --batch 4 --lr 3e-3 --threads 1 --device cpu",
    ),
    "edgemem eval --checkpoint F --task T [--length L] [--batch 128] [--seed S] [--json] [--no-memory]": Help(
        "a synopsis", instance="edgemem eval --checkpoint t.safetensors --task mqar --batch 4 --seed 1 --json"
    ),
    "edgemem linearize --checkpoint F | --hf DIR --out F.safetensors [--window 64] [--update-rule gated_delta] "
    "[--gate-init 0.5]": Help(
        "a synopsis", instance="edgemem linearize --checkpoint t.safetensors --out l.safetensors --window 8"
    ),
    "edgemem build DIR --plugins build/libedgemem_trt_plugins.so [--fp16] [--max-batch N] [--max-sequence N] "
    "[--out E] [--force]": Help(GPU),
    'cmake -S plugins -B build/rtx -DTensorRT_ROOT=TRT11_HEADERS -DCMAKE_CUDA_ARCHITECTURES="86;89;120"': Help(
        "needs nvcc and TensorRT 11's headers; tests/test_plugins.py and tests/test_rtx.py build what builds here"
    ),
    "edgemem build DIR --rtx --sm 86,89,120 --plugins build/rtx/libedgemem_trt_plugins.so": Help(
        "needs the plugin library built by nvcc; tests/test_rtx.py builds engines with a CPU-built library"
    ),
    "edgemem triton DIR --out REPO [--max-live N] [--idle-seconds S] [--prefix-cache BYTES]": Help(
        "a synopsis", instance="edgemem triton out/gdn --out repo --max-live 2 --idle-seconds 5"
    ),
    "edgemem serve REPO": Help("a synopsis: samples/triton-server/README.md's serve runs"),
    # samples/triton-server/README.md
    "pip install 'nvidia-pytriton==0.7.0' 'tritonclient[grpc]==2.73.0'": Pinned("serve"),
    "edgemem triton out/gdn --out out/models --max-live 64 --idle-seconds 600": Run(),
    "edgemem serve out/models --grpc-port 8001": Background(replace={"8001": "{port}"}),
    'python samples/triton-server/stream_client.py --url 127.0.0.1:8001 --sequence 42 --prompt "Once upon a time"': Run(
        replace={"8001": "{port}"}
    ),
    "python samples/triton-server/stream_client.py --url 127.0.0.1:8001 --sequence 42 --continue --end": Run(
        replace={"8001": "{port}"}
    ),
    # export/README.md
    "edgemem export --arch export/titans-mag-orin-nano.toml --out out/mag-nano": Run(add=SMALL),
    "edgemem train --arch export/titans-mag-orin-nano.toml --task mqar --out mag-nano.safetensors": Run(
        add=f"--steps 2 --batch 4 {SMALL}"
    ),
    # calib/README.md
    "edgemem calibrate DIR --method dynamic|static|int4 [--block-size 32] [--embeddings int4|fp32] "
    "[--recipe calib/mqar | mqar | path/to/r.toml] [--out QDIR] [--force] [--report F.json] [--plot F.png] "
    "[--no-drift]": Help("a synopsis"),
    # checkpoints/README.md: the runs that made the checkpoints, at 2 steps of batch 4
    "edgemem train --arch deltanet --task mqar --steps 1200 --set d_model=64 --set mlp_hidden=128 "
    "--out checkpoints/deltanet-mqar.safetensors": Run(replace={"--steps 1200": "--steps 2"}, add="--batch 4"),
    "edgemem train --arch gated-deltanet --task mqar --steps 800 --set d_model=64 --set mlp_hidden=128 --threads 1 "
    "--out checkpoints/gated-deltanet-mqar.safetensors": Run(replace={"--steps 800": "--steps 2"}, add="--batch 4"),
    "edgemem train --arch titans-mag --task mqar --steps 1500 --set d_model=64 --set mlp_hidden=128 --device cuda "
    "--out checkpoints/titans-mag-mqar.safetensors": Run(
        replace={"--steps 1500": "--steps 2", "--device cuda": "--device cpu"},
        add="--batch 4",
        why="no GPU here: the same run on the CPU",
    ),
    "edgemem train --arch softmax --task mqar --steps 1200 --set d_model=64 --set mlp_hidden=128 --threads 1 "
    "--out checkpoints/softmax-mqar.safetensors": Run(replace={"--steps 1200": "--steps 2"}, add="--batch 4"),
    "edgemem train --arch linear --task mqar --steps 1200 --set d_model=64 --set mlp_hidden=128 --threads 1 "
    "--out checkpoints/linear-mqar.safetensors": Run(replace={"--steps 1200": "--steps 2"}, add="--batch 4"),
    "edgemem train --arch deltanet --task bytes --steps 600 --batch 32 --set d_model=64 --set mlp_hidden=192 "
    "--threads 1 --out checkpoints/deltanet-bytes.safetensors": Run(
        replace={"--steps 600": "--steps 2", "--batch 32": "--batch 4"}
    ),
    "edgemem train --arch deltanet --task bytes --steps 1200 --batch 32 --set d_model=32 --set n_layers=1 "
    "--set mlp_hidden=96 --set num_heads=2 --threads 1 --out checkpoints/deltanet-bytes-draft.safetensors": Help(
        "the deltanet-bytes command above, run, with other --set values"
    ),
    "edgemem eval --checkpoint checkpoints/deltanet-mqar.safetensors --task mqar": Run(add="--batch 4"),
    "edgemem train --arch titans-mag --task mqar-far --task-set pairs=4 --task-set gap=32 --steps 1000 --batch 32 "
    "--set d_model=64 --set mlp_hidden=128 --set window=8 --set chunk_size=8 --set max_lr=0.1 --set momentum=false "
    "--threads 1 --out checkpoints/titans-mag-far.safetensors": Run(
        replace={"--steps 1000": "--steps 2", "--batch 32": "--batch 4"}
    ),
    "edgemem train --arch titans-mac --task mqar-far --task-set pairs=4 --task-set gap=20 --steps 1000 --batch 32 "
    "--lr 5e-3 --seed 2 --set d_model=64 --set mlp_hidden=128 --set chunk_size=8 --set max_lr=0.1 --set momentum=false "
    "--threads 1 --out checkpoints/titans-mac-far.safetensors": Run(
        replace={"--steps 1000": "--steps 2", "--batch 32": "--batch 4"}
    ),
    "edgemem train --arch led --task copy-marked --steps 1800 --lr 1e-2 --set d_model=32 --set encoder_heads=2 "
    "--set decoder_heads=2 --set encoder_ffn=64 --set decoder_ffn=64 --set 'windows=[1,8]' "
    "--set max_encoder_positions=128 --set max_decoder_positions=8 --threads 1 "
    "--out checkpoints/led-copy-marked.safetensors": Run(replace={"--steps 1800": "--steps 2"}, add="--batch 4"),
    "edgemem eval --checkpoint checkpoints/led-copy-marked.safetensors --task copy-marked": Run(add="--batch 4"),
    "edgemem export --checkpoint checkpoints/led-copy-marked.safetensors --out out/led": Help(
        "an export of a trained checkpoint; small_exports exports the led preset and verifies it (test_export.py)"
    ),
    "edgemem run out/led --ids 145,1,157,172,135,1,148,166,160,167,147,165,142,159,139,159,158,191,174,146,1,148,"
    "144,161,139,155,140,169,186,160,167,188 --global 0 --num-beams 4 --print-ids": Elsewhere(
        "tests/test_led_preset.py::test_cli_run_greedy_and_beam_on_an_encoder_decoder_export", "--num-beams"
    ),
    "edgemem eval --checkpoint checkpoints/titans-mag-far.safetensors --task mqar-far --task-set pairs=4 "
    "--task-set gap=32 [--no-memory]": Help(
        "a synopsis of two runs",
        instance="edgemem eval --checkpoint checkpoints/titans-mag-far.safetensors "
        "--task mqar-far --task-set pairs=4 --task-set gap=32 --no-memory --batch 4",
    ),
    # benchmarks/README.md
    "python benchmarks/peers.py": Help(
        "a 0.75B-parameter model for about 40 minutes; tests/test_peers_bench.py runs it with --config tiny"
    ),
    "python benchmarks/peers.py --quick": Help("as above, still the 0.75B model"),
    "python benchmarks/peers.py --engines edgemem,genai --precisions int4 --positions 1024,4096": Help(
        "as above, still the 0.75B model"
    ),
    "LLAMA_CPP_SRC=path/to/llama.cpp python benchmarks/peers.py": Help("needs a llama.cpp source tree"),
    "python benchmarks/gqa_fold.py": Help("one attention layer of the 0.75B model at 16K positions (minutes)"),
    "bash plugins/scripts/gpu_check.sh": Help("needs an NVIDIA GPU and nvcc"),
    "python benchmarks/footprint.py": Help(
        "a 45M-parameter import measured in fresh processes (minutes); tests/test_footprint.py measures a small one"
    ),
    "python benchmarks/engine_bytes.py --plugins P": Help(
        "exports three presets and builds their engines with TensorRT for RTX (minutes, the plugin library built by "
        "nvcc); tests/test_rtx.py builds one engine of a small export and checks its weights occur once"
    ),
    "python benchmarks/long_run.py": Help(
        "1,000,000 tokens (minutes); tests/test_hardening_2.py checks the resume and bounds it relies on"
    ),
    "python benchmarks/prefix_spec.py": Help(
        "a 2,048-token prompt and several models (minutes); tests/test_prefix_spec.py checks what it times"
    ),
    "python benchmarks/prefix_spec.py --parts qwen qwen-ttft --cache DIR": Help(
        "the 0.75B-parameter model, whose export needs more than 10 GB of memory; --qwen-config tiny runs the same code"
    ),
    "python benchmarks/native.py --json benchmarks/results/native.json": Help(
        "builds libedgemem in Release and streams 100,000 tokens (minutes); tests/test_native_runtime.py checks it"
    ),
    "bash native/scripts/aarch64.sh": Help("a cross toolchain, qemu-user and the aarch64 onnxruntime wheel (minutes)"),
    "python benchmarks/led_encoder.py": Help(
        "16,384 tokens through LED's encoder and transformers' (minutes); "
        "tests/test_hf_led.py checks the encoder's numbers"
    ),
    "python benchmarks/first_hour.py": Help(
        "a fresh clone and virtual environment at full sizes (about half an hour); "
        "this file runs the same commands small"
    ),
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON '
    '-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" '
    "pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36": Help(
        "a source build of llama.cpp from the network (minutes); not part of any extra"
    ),
}

# Python blocks that need hardware, by their first line: the exception they must raise here, and why.
PYTHON = {
    'engine = Engine.load("out/gdn", backend="trt", plugins="build/libedgemem_trt_plugins.so")  # or $EDGEMEM_TRT_PLUGINS': (  # noqa: E501
        EdgememError,
        GPU,
    ),
}


# ---------------------------------------------------------------- reading the READMEs
@dataclass
class Block:
    doc: str
    line: int
    lang: str  # sh | python | toml | json | text
    items: list[str]  # sh: one logical command each; otherwise the block's text


def _command_lines(body: list[str]) -> list[str]:
    """Logical commands: `\\` continuations and indented synopsis continuations joined, `# comments` dropped."""
    commands: list[str] = []
    joining = False
    for raw in body:
        if not raw.strip():
            continue
        line = re.sub(r"\s+#\s.*$", "", raw.rstrip()) if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if (joining or raw[:1].isspace()) and commands:
            commands[-1] += " " + line.strip()
        else:
            commands.append(line.strip())
        joining = commands[-1].endswith("\\")
        if joining:
            commands[-1] = commands[-1][:-1].rstrip()
    return [" ".join(c.split()) if "'" not in c and '"' not in c else c for c in commands]


def blocks(doc: str) -> list[Block]:
    lines = (ROOT / doc).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            lang = {"": "text", "bash": "sh", "shell": "sh"}.get(fence.group(1), fence.group(1))
            body = lines[i + 1 : end]
            found.append(Block(doc, i + 1, lang, _command_lines(body) if lang == "sh" else ["\n".join(body)]))
            i = end + 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            found.append(Block(doc, i + 1, "sh", _command_lines([x[4:] for x in lines[i:end]])))
            i = end
        else:
            i += 1
    return found


def _ci_command() -> str:
    line = next(x for x in (ROOT / ".ci" / "run").read_text().splitlines() if x.startswith("python3 -m venv"))
    return line.replace("pip install -q ", "pip install ").removesuffix(" || status=$?")


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _entries(command: str) -> list[tuple[str, object]]:
    if command in COMMANDS:
        return [(command, COMMANDS[command])]
    parts = command.split(" && ")
    missing = [p for p in parts if p not in COMMANDS]
    assert not missing, f"README command not in tests/test_readme.py's COMMANDS table: {missing[0]!r}"
    return [(p, COMMANDS[p]) for p in parts]


def test_every_readme_command_is_in_the_table_and_every_entry_in_a_readme():
    seen = set()
    for doc in DOCS:
        for block in blocks(doc):
            if block.lang == "sh":
                for command in block.items:
                    seen.update(text for text, _ in _entries(command))
            elif block.lang == "python" and block.items[0].splitlines()[0] in PYTHON:
                seen.add(block.items[0].splitlines()[0])
    stale = (set(COMMANDS) | set(PYTHON)) - seen
    assert not stale, f"table entries no README has any more: {sorted(stale)}"


def test_the_two_big_commands_are_what_ci_and_pyproject_say():
    readme = [c for b in blocks("README.md") if b.lang == "sh" for c in b.items]
    assert _ci_command() in readme  # the test command, letter for letter
    ci_steps = _ci_command().split(" && ")
    plain = [s.replace(" --no-compile", "") for s in ci_steps]  # CI skips pip's byte-compiling; the main job need not
    extras = _extras()
    for command in readme:
        for text, how in _entries(command):
            if isinstance(how, SetUp):
                extra = re.fullmatch(r"pip install -e '\.\[([\w,-]+)\]'", text)
                assert text in ci_steps + plain or (extra and set(extra.group(1).split(",")) <= set(extras)), text
    main_job = next(c for c in readme if c.startswith("python3 -m venv") and c != _ci_command())
    setup = main_job.split(" && ")[:4]
    assert setup == [s.replace("'.[dev]'", "'.[export]'") for s in plain[:4]]  # CI's set-up with [export]
    assert "edgemem-toolkit[export,hf,rtx,trt-lean,serve,bench]" in extras["dev"]  # [dev] holds [export]


# ---------------------------------------------------------------- running them
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _qwen_with_tokenizer(path: Path) -> None:
    """A tiny Qwen3.5 save_pretrained directory (one gated DeltaNet layer) with a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(path)
    words = ["<unk>", "Once", "upon", "a", "time", *(f"w{i}" for i in range(59))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))


class Shell:
    """Runs commands in `cwd` as a reader would type them: `edgemem` in this process, the rest as processes."""

    def __init__(self, cwd: Path):
        self.cwd, self.port, self.background = cwd, _free_port(), []
        self.ran: list[str] = []

    def _argv(self, command: str) -> tuple[dict, list[str]]:
        words = shlex.split(command)
        env = {}
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        if words[0] in ("python", "python3"):
            words[0] = sys.executable
        return env, words

    def run(self, command: str) -> str:
        self.ran.append(command)
        env, words = self._argv(command)
        if words[0] == "edgemem":
            result = CliRunner().invoke(main, words[1:], catch_exceptions=False)
            assert result.exit_code == 0, f"{command}\n{result.output[-3000:]}"
            return result.output
        done = subprocess.run(words, cwd=self.cwd, env={**os.environ, **env}, capture_output=True, timeout=300)
        stdout, stderr = (b.decode(errors="replace") for b in (done.stdout, done.stderr))  # a random model's bytes
        assert done.returncode == 0, f"{command}\n{stdout[-2000:]}\n{stderr[-3000:]}"
        return stdout

    def help(self, command: str) -> None:
        env, words = self._argv(command)
        options = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", command))
        if words[0] == "edgemem":
            sub = words[1]
            result = CliRunner().invoke(main, [sub, "--help"])
            assert result.exit_code == 0, result.output
            text = result.output
        elif words[0] == "cmake":
            assert (self.cwd / "plugins" / "CMakeLists.txt").is_file()
            text = (self.cwd / "plugins" / "CMakeLists.txt").read_text() + " --help"
            options = {f"{o}" for o in re.findall(r"-D(\w+)=", command)}
        elif words[0] == "pip":
            return
        elif words[0] == "bash":
            done = subprocess.run(["bash", "-n", words[1]], cwd=self.cwd, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr  # the script parses
            return
        else:
            done = subprocess.run(
                [*words[:2], "--help"],
                cwd=self.cwd,
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            text = done.stdout
        for option in options:
            assert option in text, f"{command}: {option} is not an option of {' '.join(words[:2])}"

    def start(self, command: str) -> None:
        self.ran.append(command)
        _, words = self._argv(command)
        argv = [sys.executable, "-c", "from edgemem.cli import main; main()", *words[1:]]
        process = subprocess.Popen(argv, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.background.append(process)
        deadline = time.monotonic() + 120
        while not self._port_open():
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, f"{command}: not ready after 120 s"
            time.sleep(0.3)

    def _port_open(self) -> bool:
        import tritonclient.grpc as grpcclient

        try:
            return grpcclient.InferenceServerClient(f"127.0.0.1:{self.port}").is_server_ready()
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        while self.background:
            process = self.background.pop()
            process.send_signal(signal.SIGTERM)
            output = process.communicate(timeout=90)[0].decode()
            assert process.returncode == 0, output[-3000:]


def _concrete(text: str, how: Run, port: int) -> str:
    command = text
    for old, new in how.replace.items():
        assert old in command, f"{text!r}: table replacement {old!r} does not occur"
        command = command.replace(old, new.format(port=port))
    return f"{command} {how.add}".strip()


def _python(block: Block, namespace: dict) -> None:
    code = block.items[0]
    first = code.splitlines()[0]
    if first in PYTHON:
        error, _why = PYTHON[first]
        with pytest.raises(error) as raised:
            exec(compile(code, f"{block.doc}:{block.line}", "exec"), namespace)  # noqa: S102 - the README's code
        assert "\n" not in str(raised.value).strip(), raised.value  # one line saying what is missing
        return
    exec(compile(code, f"{block.doc}:{block.line}", "exec"), namespace)  # noqa: S102 - the README's code


def _toml(block: Block, cwd: Path) -> None:
    path = cwd / f"readme-{block.line}.toml"
    path.write_text(block.items[0])
    if block.doc == "calib/README.md":
        from edgemem.quant import load_recipe

        load_recipe(str(path))
    elif block.doc == "export/README.md":  # the format, with the mixer's options left out: the shipped file's keys
        shown, real = (tomllib.loads(p.read_text()) for p in (path, cwd / "export" / "titans-mag-orin-nano.toml"))
        assert set(shown) == set(real) and set(shown["model"]) <= set(vars(load_config("titans-mag")))
        assert shown["mixer"]["type"] == real["mixer"]["type"]
    else:
        raise AssertionError(f"{block.doc}:{block.line}: a TOML block nothing here checks")


def _copy(tmp_path: Path) -> Path:
    repo = tmp_path / "edgemem"
    keep = (
        "README.md",
        "pyproject.toml",
        ".ci",
        "samples",
        "export",
        "calib",
        "checkpoints",
        "benchmarks",
        "plugins",
        "native",
    )
    for name in keep:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("results", "__pycache__", "build*"))
        else:
            repo.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)
    return repo


def run_doc(doc: str, tmp_path: Path, monkeypatch) -> Shell:
    repo = _copy(tmp_path)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    shell, namespace = Shell(repo), {"__name__": "__readme__"}
    if doc == "README.md":  # the reader's own model, named path/to/model in the text
        _qwen_with_tokenizer(repo / "path" / "to" / "model")
    try:
        for block in blocks(doc):
            if block.lang == "python":
                _python(block, namespace)
            elif block.lang == "toml":
                _toml(block, repo)
            elif block.lang == "sh":
                for command in block.items:
                    for text, how in _entries(command):
                        if isinstance(how, Background):
                            shell.start(_concrete(text, how, shell.port))
                        elif isinstance(how, Run):
                            shell.run(_concrete(text, how, shell.port))
                        elif isinstance(how, Help):
                            shell.help(text)
                            if how.instance:
                                shell.run(how.instance)
                        elif isinstance(how, Pinned):
                            _pinned(text, how.extra)
                        elif isinstance(how, Elsewhere):
                            _elsewhere(how)
                        # SetUp and SameAsCI: test_the_two_big_commands_are_what_ci_and_pyproject_say
                shell.stop()
    finally:
        shell.stop()
    return shell


def _elsewhere(how: Elsewhere) -> None:
    path, _, name = how.test.partition("::")
    source = (ROOT / path).read_text()
    body = source[source.index(f"def {name}(") :]
    body = body[: body.find("\ndef ", 1) if "\ndef " in body[1:] else len(body)]
    assert how.program in body, f"{how.test} does not run {how.program}"


def _pinned(command: str, extra: str) -> None:
    from packaging.requirements import Requirement

    specs = {r.name: r.specifier for r in map(Requirement, _extras()[extra])}
    for word in shlex.split(command)[2:]:
        req = Requirement(word)
        (pin,) = [s.version for s in req.specifier if s.operator == "=="]
        assert specs[req.name].contains(pin), f"{word} is outside [{extra}]'s {specs[req.name]}"
        assert importlib.metadata.version(req.name) == pin, (
            f"{word}: the tests run {importlib.metadata.version(req.name)}"
        )


FAST = ["samples/README.md", "export/README.md", "calib/README.md", "checkpoints/README.md", "benchmarks/README.md"]


@pytest.mark.parametrize("doc", FAST)
def test_readme_commands_run(doc, tmp_path, monkeypatch):
    run_doc(doc, tmp_path, monkeypatch)


@pytest.mark.slow  # README.md: four exports, an import and the checks; the Triton sample: a tritonserver
@pytest.mark.parametrize("doc", [d for d in DOCS if d not in FAST])
def test_readme_commands_run_long(doc, tmp_path, monkeypatch):
    if doc == "README.md":
        pytest.importorskip("transformers", reason="the own-model section makes its model with the [hf] extra")
    else:
        pytest.importorskip("pytriton", reason="tritonserver comes from the nvidia-pytriton wheel ([serve] extra)")
    assert run_doc(doc, tmp_path, monkeypatch).ran
