"""Stream greedy bytes from the Triton Python-backend model that `edgemem triton` writes, over gRPC.

    edgemem export --arch gated-deltanet --out out/gdn
    edgemem triton out/gdn --out out/models
    edgemem serve out/models --grpc-port 8001            # in another terminal; Ctrl-C stops it
    python samples/triton-server/stream_client.py --url 127.0.0.1:8001 --sequence 42 --prompt "Once upon a time"
    python samples/triton-server/stream_client.py --url 127.0.0.1:8001 --sequence 42 --continue

Each request carries the sequence id (Triton's correlation id): the first one has the START flag and
the prompt, every later one one token. The server keeps the stream between requests — in memory, or
in a checkpoint file when it was idle, the server was restarted or too many sequences were live — so
`--continue` carries on where the last run stopped. `--end` ends the sequence (its state is dropped).
"""

import argparse
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def request(client, model: str, sequence: int, tokens: list[int], start: bool = False, end: bool = False):
    """Feed tokens to the sequence; returns the next-token logits and the sequence's position."""
    data = np.asarray(tokens, dtype=np.int64)
    tensor = grpcclient.InferInput("TOKENS", list(data.shape), "INT64")
    tensor.set_data_from_numpy(data)
    result = client.infer(model, [tensor], sequence_id=sequence, sequence_start=start, sequence_end=end)
    return result.as_numpy("LOGITS"), int(result.as_numpy("POSITION")[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    parser.add_argument("--model", default="gated-deltanet", help="the Python-backend model's name")
    parser.add_argument("--sequence", type=int, default=1, help="sequence id (a positive integer)")
    parser.add_argument("--prompt", default="Once upon a time", help="text that starts a new sequence")
    parser.add_argument("--continue", dest="resume", action="store_true", help="continue the sequence instead")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--end", action="store_true", help="end the sequence after the last token")
    args = parser.parse_args()

    client = grpcclient.InferenceServerClient(args.url)
    if args.resume:  # no tokens: the sequence's next-token logits, from memory or its checkpoint
        logits, _ = request(client, args.model, args.sequence, [])
    else:
        logits, _ = request(client, args.model, args.sequence, list(args.prompt.encode()), start=True)
    for i in range(args.max_new_tokens):
        token = int(logits.argmax())
        sys.stdout.buffer.write(bytes([token]))
        sys.stdout.buffer.flush()
        logits, position = request(client, args.model, args.sequence, [token],
                                   end=args.end and i == args.max_new_tokens - 1)
    print(f"\n[sequence {args.sequence} at position {position}]", file=sys.stderr)


if __name__ == "__main__":
    main()
