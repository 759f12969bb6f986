"""Stream greedy bytes from the Triton Python-backend model that `edgemem triton` writes, over gRPC.

    edgemem export --arch gated-deltanet --out out/gdn
    edgemem triton out/gdn --out out/models
    edgemem serve out/models --grpc-port 8001            # in another terminal; Ctrl-C stops it
    python samples/triton-server/stream_client.py --url 127.0.0.1:8001 --sequence 42 --prompt "Once upon a time"
    python samples/triton-server/stream_client.py --url 127.0.0.1:8001 --sequence 42 --continue

Each request carries the sequence id (Triton's correlation id): the first one has the START flag and
the prompt, every later one one token. The client asks the server for its model (`--model NAME` picks
one when it has several); a byte-level model takes `--prompt` text and prints text, any other takes
`--ids 1,2,3` and prints token ids. The server keeps the stream between requests — in memory, or
in a checkpoint file when it was idle, the server was restarted or too many sequences were live — so
`--continue` carries on where the last run stopped. `--end` ends the sequence (its state is dropped).
"""

import argparse
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def request(client, model: str, sequence: int, tokens: list[int], start: bool = False, end: bool = False):
    """Feed tokens to the sequence; returns the next-token logits and the sequence's position."""
    data = np.asarray(tokens, dtype=np.int64)
    tensor = grpcclient.InferInput("TOKENS", list(data.shape), "INT64")
    tensor.set_data_from_numpy(data)
    result = client.infer(model, [tensor], sequence_id=sequence, sequence_start=start, sequence_end=end)
    return result.as_numpy("LOGITS"), int(result.as_numpy("POSITION")[0])


def streaming_models(client) -> dict[str, int]:
    """The ready models that take TOKENS (the Python-backend models of `edgemem triton`) and their vocabulary sizes."""
    found = {}
    for entry in client.get_model_repository_index().models:
        if entry.state != "READY":
            continue
        metadata = client.get_model_metadata(entry.name)
        if [i.name for i in metadata.inputs] == ["TOKENS"]:
            found[entry.name] = next(int(o.shape[-1]) for o in metadata.outputs if o.name == "LOGITS")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    parser.add_argument("--model", help="the Python-backend model's name (default: the one the server has)")
    parser.add_argument("--sequence", type=int, default=1, help="sequence id (a positive integer)")
    parser.add_argument(
        "--prompt", default="Once upon a time", help="text that starts a new sequence (byte-level models)"
    )
    parser.add_argument("--ids", help="token ids that start a new sequence instead, e.g. 1,2,3 (any model)")
    parser.add_argument("--continue", dest="resume", action="store_true", help="continue the sequence instead")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--end", action="store_true", help="end the sequence after the last token")
    args = parser.parse_args()
    try:
        stream(args)
    except InferenceServerException as e:
        sys.exit(f"error: {args.url}: {e.message()}")


def stream(args: argparse.Namespace) -> None:
    client = grpcclient.InferenceServerClient(args.url)
    models = streaming_models(client)
    if args.model is None:
        if len(models) != 1:
            sys.exit(
                f"error: {args.url} serves {', '.join(sorted(models)) or 'no model that takes TOKENS'}: "
                "pass --model NAME" + ("" if models else " (a model written by `edgemem triton`)")
            )
        args.model = next(iter(models))
    elif args.model not in models:
        sys.exit(
            f"error: {args.url} has no ready model {args.model!r} that takes TOKENS; it has: "
            f"{', '.join(sorted(models)) or 'none'}"
        )
    as_bytes = models[args.model] == 256  # a byte-level model: text in, text out; else token ids
    if args.ids is not None:
        try:
            prompt = [int(t) for t in args.ids.replace(",", " ").split()]
        except ValueError:
            sys.exit(f"error: --ids {args.ids!r}: expected token ids such as 1,2,3")
    elif as_bytes:
        prompt = list(args.prompt.encode())
    else:
        sys.exit(
            f"error: {args.model} has a vocabulary of {models[args.model]}, not bytes: give token ids (--ids 1,2,3)"
        )
    if args.resume:  # no tokens: the sequence's next-token logits, from memory or its checkpoint
        logits, position = request(client, args.model, args.sequence, [])
    else:
        logits, position = request(client, args.model, args.sequence, prompt, start=True)
    for i in range(args.max_new_tokens):
        token = int(logits.argmax())
        sys.stdout.buffer.write(bytes([token]) if as_bytes else f"{' ' if i else ''}{token}".encode())
        sys.stdout.buffer.flush()
        logits, position = request(
            client, args.model, args.sequence, [token], end=args.end and i == args.max_new_tokens - 1
        )
    print(f"\n[{args.model}: sequence {args.sequence} at position {position}]", file=sys.stderr)


if __name__ == "__main__":
    main()
