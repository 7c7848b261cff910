"""Content is text, never markup: special-token text in what a dialogue carries (a tool's output,
an agent's or a user's message, tool-call arguments, tool schemas) is tokenized as text, so that
no content can forge a turn of the episode the model is trained on (``bridge.ChatCodec`` renders
and bridges through it, and counts what it finds)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from relayrl.common.rpc import FailedPrecondition

ROLES = frozenset({"system", "user", "assistant", "tool", "ipython", "developer", "function"})
"""Roles the special-token alarm names; any other role is counted as "other" (and the tool
schemas as "tools"): a bounded set of label values."""
Message = Mapping[str, Any]
Tools = Sequence[Mapping[str, Any]] | None


class ContentGuard:
    """Keeps what a dialogue carries from becoming the template's markup: in any string given to
    the template, a special token's text is tokenized as text.

    ``escape`` swaps each special token's text in the dialogue's strings for a stand-in (letters
    and digits around a random nonce: they survive what templates do to content, ``trim``,
    ``tojson``, ``split``); the template renders; ``encode`` then cuts the rendering at the
    special tokens left in it, all the template's own, and encodes each piece between with the
    original text put back and special tokens off (a private copy of the tokenizer: transformers'
    ``split_special_tokens=True`` flips a flag on the shared Rust tokenizer that other threads
    encode with). A rendering without stand-ins is encoded whole, as before. A stand-in only
    ever turns back into text, so even a client that learnt the nonce can forge no special id.

    Not caught: a special token the template itself assembles from two adjacent strings, or
    by replacing text inside one (none of the supported templates does either).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        # text -> (id, lstrip, rstrip): the tokens the tokenizer matches in raw text as specials
        self._tokens = {
            t.content: (i, bool(getattr(t, "lstrip", False)), bool(getattr(t, "rstrip", False)))
            for i, t in added.items()
            if getattr(t, "special", True) and t.content
        }
        self._texts = sorted(self._tokens, key=len, reverse=True)  # longest first, as the tokenizer
        self._index = {t: k for k, t in enumerate(self._texts)}
        self._find = re.compile("|".join(map(re.escape, self._texts))) if self._texts else None
        self._tag = f"relayrl{secrets.token_hex(8)}s"
        self._stand_in = re.compile(re.escape(self._tag) + r"(\d+)x")

    def escape(
        self, messages: Sequence[Message], tools: Tools
    ) -> tuple[list[Message], Tools, list[str], set[str]]:
        """``(messages, tools, roles, found)``: the dialogue with special-token text swapped for
        stand-ins (messages without any are passed as they are), the roles of the messages that
        held some (``"tools"`` for the tool schemas) and the special tokens' texts found."""
        out, roles, found = list(messages), [], set()
        if self._find is None:
            return out, tools, roles, found
        for k, m in enumerate(out):
            if self._holds(m):
                out[k] = self._swap(m, found)
                role = m.get("role")
                roles.append(role if isinstance(role, str) and role in ROLES else "other")
        if tools and self._holds(tools):
            tools = self._swap(list(tools), found)
            roles.append("tools")
        return out, tools, roles, found

    def _holds(self, value: Any) -> bool:
        if isinstance(value, str):
            return self._find.search(value) is not None
        if isinstance(value, Mapping):
            return any(self._holds(k) or self._holds(v) for k, v in value.items())
        if isinstance(value, list | tuple):
            return any(self._holds(v) for v in value)
        return False

    def _swap(self, value: Any, found: set[str]) -> Any:
        if isinstance(value, str):

            def stand_in(m: re.Match) -> str:
                found.add(m.group())
                return f"{self._tag}{self._index[m.group()]}x"

            return self._find.sub(stand_in, value)
        if isinstance(value, Mapping):
            return {self._swap(k, found): self._swap(v, found) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._swap(v, found) for v in value]
        return value

    def encode(self, text: str) -> list[int]:
        """Ids of a rendering of an escaped dialogue: its special tokens as themselves, the
        stand-ins' text as text."""
        if self._tag not in text:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids: list[int] = []
        for piece in self._split(text):
            if isinstance(piece, int):
                ids.append(piece)
            elif self._tag in piece:
                plain = self._stand_in.sub(lambda m: self._texts[int(m.group(1))], piece)
                ids.extend(self._text_encoder.encode(plain, add_special_tokens=False).ids)
            else:
                ids.extend(self.tokenizer.encode(piece, add_special_tokens=False))
        return ids

    def _split(self, text: str) -> list[str | int]:
        """``text`` cut at its special tokens (left to right, longest first, whitespace taken
        by ``lstrip``/``rstrip`` tokens as the tokenizer does): text pieces and token ids."""
        out: list[str | int] = []
        pos = 0
        for m in self._find.finditer(text):
            start, end = m.span()
            if start < pos:  # inside the whitespace an rstrip token took
                continue
            tid, lstrip, rstrip = self._tokens[m.group()]
            if lstrip:
                start = pos + len(text[pos:start].rstrip())
            if rstrip:
                end = _SPACES.match(text, end).end()
            out += [text[pos:start], tid]
            pos = end
        out.append(text[pos:])
        return [p for p in out if p != ""]

    @cached_property
    def _text_encoder(self) -> Any:
        """A private copy of the tokenizer with special tokens off (``encode_special_tokens``)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise FailedPrecondition(
                "content holds special-token text and this tokenizer has no fast (Rust) backend "
                "to tokenize it as text"
            )
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(backend.to_str())
        copy.no_truncation()
        copy.no_padding()
        copy.encode_special_tokens = True
        return copy


_SPACES = re.compile(r"\s*")
