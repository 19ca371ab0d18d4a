"""Text around a route session, with the model's own tokenizer and chat template on the head:

- :func:`chat_prompt_text`: chat messages -> prompt text (the worker's ``ApplyChatTemplate``:
  llama.cpp's template engine with the GGUF's ``tokenizer.chat_template``);
- :class:`PieceCache`: token id -> its text bytes (``Detokenize`` with ``include_pieces``), looked
  up once per id, so streaming text costs no re-detokenization of the whole answer;
- :class:`TextDecoder`: those bytes -> text, incrementally (a UTF-8 sequence split across two
  tokens is emitted once whole).
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from dgr.protocol.client import AsyncWorkerClient


async def chat_prompt_text(client: "AsyncWorkerClient", messages: Sequence[tuple[str, str]], *,
                           timeout: float) -> str:
    """The prompt text for ``messages`` (role, content), ending with the assistant's prefix.
    Raises the client's WorkerError when the model has no (usable) chat template
    (INVALID_ARGUMENT; UNIMPLEMENTED from an older worker)."""
    return await client.apply_chat_template(messages, add_assistant=True, timeout=timeout)


class PieceCache:
    """Token id -> its text bytes, asked of ``client`` (the head's protocol client) once per id;
    a failed lookup raises the client's WorkerError."""

    def __init__(self, client: "AsyncWorkerClient", *, timeout: float) -> None:
        self.client, self.timeout = client, timeout
        self._pieces: dict[int, bytes] = {}

    async def prefetch(self, n_vocab: int, chunk: int = 65536) -> None:
        """Every token's piece up front (a few hundred kB for a 50k vocabulary), so that no
        token of an answer waits for a lookup."""
        for a in range(0, n_vocab, chunk):
            await self.pieces(range(a, min(n_vocab, a + chunk)))

    async def pieces(self, toks: Sequence[int]) -> list[bytes]:
        unknown = sorted({t for t in toks if t not in self._pieces})
        if unknown:
            self._pieces.update(zip(unknown, await self.client.pieces(unknown, timeout=self.timeout)))
        return [self._pieces[t] for t in toks]


class TextDecoder:
    """Token bytes -> text as it becomes complete (invalid bytes become U+FFFD, as a one-shot
    decode would)."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes, final: bool = False) -> str:
        return self._dec.decode(data, final)
