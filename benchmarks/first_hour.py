"""A newcomer's first hour: README.md top to bottom on a fresh clone in a fresh virtual environment, at
full sizes, each step's wall time and output length (lines, characters) written to a Markdown table.

    python benchmarks/first_hour.py [--source .] [--work /tmp/edgemem-first-hour] [--out benchmarks/results/first_hour.md]

The steps are the README's commands in its order (synopses instantiated with the README's own values);
the Python steps are the README's Python blocks, read from README.md at run time.
"""  # noqa: E501

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A Qwen3.5-shaped save_pretrained directory standing in for the reader's own model (random weights).
MODEL = """
import torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers
config = transformers.Qwen3_5TextConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
    linear_num_value_heads=4, eos_token_id=None, pad_token_id=None, bos_token_id=None)
torch.manual_seed(0)
transformers.Qwen3_5ForCausalLM(config).save_pretrained("path/to/model")
words = ["<unk>", "Once", "upon", "a", "time", *(f"w{i}" for i in range(4091))]
tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer.save("path/to/model/tokenizer.json")
"""  # noqa: E501


def python_block(readme: str, first: str) -> str:
    """The README's Python block whose first code line starts with `first`."""
    for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S):
        if any(line.startswith(first) for line in block.splitlines()[:3]):
            return block
    raise SystemExit(f"README.md has no Python block starting with {first!r}")


def steps(readme: str) -> list[tuple[str, str]]:
    return [
        ("python3 -m venv .venv", "python3 -m venv .venv"),
        ("pip install torch==2.13.0", "pip install torch==2.13.0"),
        ("pip install -e '.[export]'", "pip install -e '.[export]'"),
        ("edgemem archs", "edgemem archs"),
        ("edgemem export --arch titans-mag --out out/titans-mag --force", None),
        ("edgemem verify out/titans-mag", None),
        ("Python: the stateful protocol", "python - <<'EOF'\n" + python_block(readme, "import torch") + "EOF"),
        ("edgemem export --arch gated-deltanet --out out/gdn", None),
        (
            "Python: the runtime",
            "python - <<'EOF'\n" + python_block(readme, "from edgemem.runtime import Engine") + "EOF",
        ),
        ("edgemem run out/gdn --prompt Hello --max-new-tokens 32", None),
        ("edgemem bench out/gdn --positions 1000 --batch 1,8", None),
        ("pip install -e '.[hf]'", None),
        ("(a Qwen3.5-shaped model: 4 layers, hidden 256, vocab 4096)", "python - <<'EOF'\n" + MODEL + "EOF"),
        ("edgemem export --hf path/to/model --out out/mine", None),
        ("edgemem verify out/mine", None),
        ('edgemem run out/mine --prompt "Once upon a time" --max-new-tokens 32', None),
        (
            "Python: your own model",
            "python - <<'EOF'\n" + python_block(readme, "from edgemem.models import from_hf") + "EOF",
        ),
        ("edgemem calibrate out/gdn --method int4", None),
        ("edgemem run out/gdn-int4 --prompt Hello --max-new-tokens 32", None),
        ("edgemem calibrate out/gdn --method dynamic --no-drift", None),
        (
            "edgemem train --arch deltanet --task mqar --steps 100 --set d_model=64 --set mlp_hidden=128 --out mqar.safetensors",  # noqa: E501
            None,
        ),
        ("edgemem eval --checkpoint checkpoints/deltanet-mqar.safetensors --task mqar", None),
        ("edgemem linearize --hf path/to/model --out liza.safetensors", None),
        ("edgemem export --checkpoint liza.safetensors --out out/liza", None),
        ("edgemem triton out/gdn --out out/models", None),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default=str(ROOT), help="the repository to clone (a path or URL)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgemem-first-hour"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "first_hour.md")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per step")
    args = ap.parse_args()
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    rows, start = [], time.monotonic()
    began = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    clone = subprocess.run(
        ["git", "clone", "-q", args.source, str(args.work / "edgemem")], capture_output=True, text=True
    )
    if clone.returncode:
        raise SystemExit(clone.stderr)
    commit = subprocess.run(
        ["git", "-C", str(args.work / "edgemem"), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    readme = (args.work / "edgemem" / "README.md").read_text()
    for label, command in steps(readme):
        script = command or label
        activate = "" if script.startswith("python3 -m venv") else ". .venv/bin/activate && "
        t0 = time.monotonic()
        try:
            done = subprocess.run(
                ["bash", "-c", activate + script],
                cwd=args.work / "edgemem",
                capture_output=True,
                text=True,
                errors="replace",
                timeout=args.timeout,
            )
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            code, output = (
                "timeout",
                (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"),
            )
        seconds = time.monotonic() - t0
        rows.append((label, seconds, code, output.count("\n"), len(output), output.strip().splitlines()[-1:] or [""]))
        print(f"{seconds:8.1f} s  exit {code}  {output.count(chr(10)):5d} lines  {label}", flush=True)
    total = time.monotonic() - start
    lines = [
        "# First hour: README.md top to bottom on a fresh clone",
        "",
        f"`python benchmarks/first_hour.py`, {began}, commit {commit}, {sys.platform}, Python "
        f"{sys.version.split()[0]}; a fresh clone and a fresh virtual environment; total {total / 60:.1f} min.",
        "Output length is stdout and stderr together, as a terminal-less run (a pipe) gets them.",
        "",
        "| step | wall s | exit | output lines | output chars | last line of output |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, seconds, code, n_lines, n_chars, last in rows:
        tail = last[0][:100].replace("|", "\\|")
        lines.append(f"| `{label}` | {seconds:.1f} | {code} | {n_lines} | {n_chars} | {tail} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r[2] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
