"""A byte-level tokenizer built in code (no hub): token ``b`` (0-255) is byte ``b``; then BOS,
EOS and PAD.  Enough for demos and tests with tiny random models (vocab >= 259)."""

from __future__ import annotations

from collections.abc import Sequence


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus ``bos_token_id`` (256), ``eos_token_id`` (257) and
    ``pad_token_id`` (258)."""

    num_bytes = 256

    def __init__(self, add_bos: bool = True) -> None:
        self.bos_token_id = 256
        self.eos_token_id = 257
        self.pad_token_id = 258
        self.vocab_size = 259
        self.add_bos = add_bos

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t for t in token_ids if 0 <= t < 256)
        if not skip_special_tokens:
            names = {self.bos_token_id: "<s>", self.eos_token_id: "</s>", self.pad_token_id: "<pad>"}
            parts: list[str] = []
            buf = bytearray()
            for t in token_ids:
                if 0 <= t < 256:
                    buf.append(t)
                else:
                    parts.append(buf.decode("utf-8", errors="replace"))
                    buf.clear()
                    parts.append(names.get(t, f"<{t}>"))
            parts.append(buf.decode("utf-8", errors="replace"))
            return "".join(parts)
        return data.decode("utf-8", errors="replace")
