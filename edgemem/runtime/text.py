"""Text ↔ token ids for an export (no torch): the tokenizer that travelled with it (the
`tokenizers` package reads its `tokenizer.json`), or UTF-8 bytes for a byte-level model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from edgemem.errors import EdgememError
from edgemem.manifest import Manifest


class TextCodec:
    """encode: text → ids; decode: ids → text. `Stream.prefill` keeps taking ids."""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Text pieces as ids arrive; a piece is held back while it ends in an incomplete character."""
        seen: list[int] = []
        shown = ""
        for token in ids:
            seen.append(token)
            text = self.decode(seen)
            if text.endswith("\ufffd"):
                continue
            if text.startswith(shown):
                piece, shown = text[len(shown) :], text
                if piece:
                    yield piece
        text = self.decode(seen)
        if text.startswith(shown) and len(text) > len(shown):
            yield text[len(shown) :]


class ByteCodec(TextCodec):
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogateescape"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", "replace")


class TokenizerCodec(TextCodec):
    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise EdgememError(
                f"{path.parent.parent} carries a tokenizer: pip install 'edgemem-toolkit[text]' to encode text"
            ) from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises a bare Exception for a malformed file
            raise EdgememError(f"{path} is not a readable tokenizer.json: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def load_codec(directory: str | Path, manifest: Manifest, *, required: bool = True) -> TextCodec | None:
    """The export's tokenizer if it has one, else bytes (a byte-level model, vocab 256); neither: an
    error, or None when not `required`."""
    name = manifest.config.get("tokenizer")
    if name:
        return TokenizerCodec(Path(directory) / name)
    if manifest.vocab_size != 256:
        if not required:
            return None
        raise EdgememError(
            f"{manifest.arch} has a vocabulary of {manifest.vocab_size} and its export carries no "
            "tokenizer: pass token ids from Python (edgemem.runtime) instead of text"
        )
    return ByteCodec()
