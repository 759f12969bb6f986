"""Train a preset on a task (`edgemem.tasks`) and evaluate checkpoints.

Training uses the model's parallel `forward`, cross-entropy over the scored targets, AdamW
with a linear warmup and a cosine decay to a tenth of the peak rate, and gradient clipping
at norm 1. Evaluation streams held-out data through `prefill` in chunks (constant memory for
recurrent models), the stateful path a deployed model runs. A sequence-to-sequence task
(`copy-marked`) trains an encoder-decoder on teacher-forced outputs and is scored by what it
generates: each input encoded once (`start`), then greedy `step`s from the start token.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edgemem import kinds
from edgemem.errors import ConfigError, EdgememError
from edgemem.files import check_output_file
from edgemem.layers.titans import NeuralMemoryLayer
from edgemem.models import LM, build, load_checkpoint, save_checkpoint
from edgemem.models.seq2seq import EncoderDecoder
from edgemem.tasks import VOCAB, Pairs, Sample, Task, get_task, train_rng

log = logging.getLogger(__name__)


class TrainingError(EdgememError):
    """Training that cannot go on (a non-finite loss)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `train`: `steps` steps were completed, and saved to `out` when one was given."""

    def __init__(self, steps: int, out: Path | None):
        super().__init__(steps, out)
        self.steps, self.out = steps, out


@dataclass
class TrainResult:
    model: LM | EncoderDecoder
    losses: list[float] = field(default_factory=list)  # one per step
    seconds: float = 0.0


def _task(task: str | Task, params: dict[str, Any] | None = None) -> Task:
    return task if isinstance(task, Task) else get_task(task, **(params or {}))


def _loss(model: nn.Module, sample: Sample | Pairs, device: torch.device) -> torch.Tensor:
    tokens, targets = (torch.from_numpy(t).to(device) for t in (sample.tokens, sample.targets))
    if isinstance(sample, Pairs):
        inputs, mask = (torch.from_numpy(t).to(device) for t in (sample.inputs, sample.global_mask))
        logits = model(inputs, tokens, mask)
    else:
        logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


def train(
    arch: str | LM | EncoderDecoder,
    task: str | Task,
    steps: int,
    out: str | Path | None = None,
    *,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    task_params: dict[str, Any] | None = None,
    batch: int = 64,
    length: int | None = None,
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    warmup: int | None = None,
    progress: bool = True,
    device: str = "cpu",
    tokenizer: Sequence[str | Path] = (),
) -> TrainResult:
    """Train `build(arch, seed=seed, **overrides)`, or `arch` itself when it is an LM (a linearized
    model, say), on `task` for `steps` steps of `batch` sequences of `length` tokens (default: the
    task's episode length) on `device` (a torch device: "cpu", "cuda"); save to `out` if given, with the
    `tokenizer` files of the model it came from beside it. The returned model is on the CPU."""
    if steps < 1 or batch < 1:
        raise ConfigError(f"steps and batch must be positive; got steps={steps}, batch={batch}")
    if not lr > 0 or weight_decay < 0:
        raise ConfigError(f"lr must be positive and weight_decay ≥ 0; got lr={lr}, weight_decay={weight_decay}")
    task = _task(task, task_params)
    length = length or task.length
    out = check_output_file(out, "checkpoint") if out is not None else None
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise ConfigError(f"cannot train on device {str(device)!r}: {str(e).splitlines()[0]}") from None
    given = isinstance(arch, nn.Module)
    if given and overrides:
        raise ConfigError("overrides build a preset; a given model is trained as it is")
    model = arch if given else build(arch, seed=seed, **(overrides or {}))
    arch = model.config.arch
    _check_model(model, task)
    if task.kind == "lm" and not model.streaming:
        raise ConfigError(
            f"{arch} is bidirectional (every position sees the whole sequence) and {task.name} is a "
            "next-token task: it would see its targets; train a causal preset"
        )
    model = model.to(device)
    model.train()
    rng = train_rng(seed)
    warmup = min(steps // 10, 200) if warmup is None else warmup
    if not 0 <= warmup <= steps:
        raise ConfigError(f"warmup must be in 0..steps ({steps}); got {warmup}")

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * t))

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    log.info(
        "training %s on %s: %d steps × %d × %d tokens, %d parameters",
        arch,
        task.name,
        steps,
        batch,
        length,
        sum(p.numel() for p in model.parameters()),
    )
    result = TrainResult(model)
    start = time.perf_counter()
    with _progress(progress, f"training {arch} on {task.name}", steps) as advance, _deferred_interrupt() as interrupted:
        for step in range(steps):
            if interrupted.is_set():
                model.to("cpu").eval()
                if out is not None and step:
                    save_checkpoint(model, out, tokenizer)
                raise Interrupted(step, out if step else None)
            loss = _loss(model, task.batch(batch, length, rng), device)
            if not torch.isfinite(loss):
                kept = f"; {out} was not written" if out is not None else ""
                raise TrainingError(
                    f"the loss is {loss.item()} at step {step + 1} of {steps}: training diverged "
                    f"(lower --lr or check --set values){kept}"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            result.losses.append(loss.item())
            advance(result.losses[-1])
            if (step + 1) % max(1, steps // 10) == 0:
                log.info("step %d/%d: loss %.4f", step + 1, steps, result.losses[-1])
    result.seconds = time.perf_counter() - start
    model.to("cpu").eval()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(model, out, tokenizer)
        log.info("saved %s after %.0f s", out, result.seconds)
    return result


def _check_model(model: nn.Module, task: Task) -> None:
    """`model` is of the kind `task` trains, and speaks its token ids (and its start and end token)."""
    kind = kinds.of(model).name
    if kind != task.kind:
        wanted = "an encoder-decoder (--arch led)" if task.kind == "encoder_decoder" else "a language model"
        raise ConfigError(f"{task.name} trains {wanted}; {model.config.arch} is of kind {kind}")
    if model.config.vocab_size < VOCAB:
        raise ConfigError(
            f"{task.name} feeds byte ids 0-{VOCAB - 1} (edgemem.tasks) but {model.config.arch} has a "
            f"vocabulary of {model.config.vocab_size}: the tasks need a model of at least {VOCAB} tokens"
        )
    if kind == "encoder_decoder":
        config, end = model.config, task.end_token
        if config.decoder_start_token_id != end or config.eos_token_id != end:
            raise ConfigError(
                f"{task.name} starts and ends its outputs with token {end}; {config.arch} has "
                f"decoder_start_token_id={config.decoder_start_token_id}, eos_token_id={config.eos_token_id}"
            )


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[threading.Event]:
    """Ctrl-C sets the yielded event, to stop between steps; a second Ctrl-C interrupts at once.
    Off the main thread (where signals cannot be handled) the event is never set."""
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return

    def handler(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _progress(enabled: bool, description: str, total: int) -> Iterator[Callable[[float], None]]:
    """Progress with the loss on stderr (edgemem.progress), or nothing; yields `advance(loss)`."""
    if not enabled:
        yield lambda loss: None
        return
    from edgemem.progress import track

    with track(description, total) as bar:
        yield lambda loss: bar.update(advance=1, loss=f"{loss:.4f}")


@torch.no_grad()
def without_memory(model: LM) -> LM:
    """`model` (changed in place) with every neural memory's writes turned off: the gates θ (inner
    learning rate) and α (forgetting) are forced to 0, so each memory stays at its learned M_0 and
    reads M_0(q) at every token (momentum stays 0: it only accumulates θ-scaled gradients)."""
    layers = [m for m in model.modules() if isinstance(m, NeuralMemoryLayer)]
    if not layers:
        raise ConfigError(f"a {model.config.arch} model has no neural memory to turn off")
    for layer in layers:
        for gate in (layer.theta, layer.alpha):
            if gate is not None:
                gate.weight.zero_()
                gate.bias.fill_(-1e4)  # σ(−10⁴) = 0 exactly in float32 and float64
    return model


@torch.no_grad()
def evaluate(
    checkpoint_or_model: str | Path | nn.Module,
    task: str | Task,
    length: int | None = None,
    batch: int = 64,
    seed: int = 0,
    *,
    task_params: dict[str, Any] | None = None,
    chunk: int = 1024,
) -> dict[str, Any]:
    """The task's metric on `batch` held-out streams of `length` tokens (default: the task's
    episode length): `{"task", "arch", "length", <metric>}`; a sequence-to-sequence task's inputs
    are `length` tokens long, and both its metrics are given (`exact_match`, `token_accuracy`)."""
    task = _task(task, task_params)
    length = length or task.length
    if batch < 1 or length < 1 or chunk < 1:
        raise ConfigError(f"batch, length and chunk must be positive; got {batch}, {length}, {chunk}")
    model = checkpoint_or_model if isinstance(checkpoint_or_model, nn.Module) else load_checkpoint(checkpoint_or_model)
    _check_model(model, task)
    model.eval()
    sample = task.stream(batch, length, seed)
    if isinstance(sample, Pairs):
        return {"task": task.name, "arch": model.config.arch, "length": length, **_seq2seq_scores(model, sample)}
    if model.streaming:
        state = model.init_state(batch)
        pieces = []
        for begin in range(0, length, chunk):
            logits, state = model.prefill(torch.from_numpy(sample.tokens[:, begin : begin + chunk]), state)
            pieces.append(_chunk_score(task, logits.numpy(), sample.targets[:, begin : begin + chunk]))
    else:
        logits = model(torch.from_numpy(sample.tokens))
        pieces = [_chunk_score(task, logits.numpy(), sample.targets)]
    count = sum(n for _, n in pieces)
    if not count:
        raise ConfigError(f"a {task.name} stream of {length} tokens has no scored position")
    value = sum(s * n for s, n in pieces) / count
    return {"task": task.name, "arch": model.config.arch, "length": length, task.metric: value}


def _seq2seq_scores(model: EncoderDecoder, pairs: Pairs) -> dict[str, float]:
    """exact_match: the share of inputs whose greedy output, as long as the target, is the target
    (so the end token comes where the target's does); token_accuracy: teacher-forced argmax accuracy."""
    inputs, mask, tokens, targets = (
        torch.from_numpy(t) for t in (pairs.inputs, pairs.global_mask, pairs.tokens, pairs.targets)
    )
    state = model.start(inputs, mask)
    logits, _ = model.prefill(tokens, state)
    scored = targets >= 0
    token_accuracy = float((logits.argmax(-1) == targets)[scored].float().mean())
    generated, token = [], torch.full_like(tokens[:, 0], model.config.decoder_start_token_id)
    for _ in range(targets.shape[1]):
        step, state = model.step(token, state)
        token = step.argmax(-1)
        generated.append(token)
    exact = ((torch.stack(generated, 1) == targets) | ~scored).all(1)
    return {"exact_match": float(exact.float().mean()), "token_accuracy": token_accuracy}


def _chunk_score(task: Task, logits: np.ndarray, targets: np.ndarray) -> tuple[float, int]:
    """(metric, scored positions) of one chunk; every metric is a mean, so chunks combine by weight."""
    n = int((targets >= 0).sum())
    return (task.score(logits, targets) if n else 0.0), n
