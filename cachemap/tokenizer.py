"""A model's tokenizer and chat template, loaded from a Hugging Face model directory.

What both sides of the wire load: the simulated engine (`loadgen.engine.tokenizer`, which adds
its load-generation helpers) and the gateway's precise mode (`gateway.events.keys`), which must
turn a request into exactly the token ids the engine will cache. A directory holds
`tokenizer.json` (the BPE, its pre-tokenizer and added tokens) and `tokenizer_config.json` (the
special tokens and `chat_template`); nothing is fetched from a hub.

Requests become prompts as vLLM makes them (`prompt_of`): a chat (`messages`, `tools`,
`add_generation_prompt` default true, `continue_final_message` default false) is rendered with
the template (a multimodal model's images: `with_images`); a completion's `prompt` is a string
(or a list of one string) tokenized as it is, or a list of token ids taken as they are. A
malformed request raises `ChatTemplateError` (a `ValueError`) naming what is wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from tokenizers import AddedToken, Tokenizer

from cachemap.chat_template import ChatTemplate, ChatTemplateError
from cachemap.multimodal import Placeholder, expand, has_parts, identify, image_identifiers


def chat_flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """A chat request's boolean option (`add_generation_prompt`, `continue_final_message`)."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatTemplateError(f"'{name}' must be true or false")
    return value


def _plain(token: AddedToken) -> bool:
    """Whether an added token holds no whitespace and strips nothing beside it: text cut at a
    space next to it encodes piece by piece as it does whole."""
    return not (
        token.lstrip or token.rstrip or token.single_word or any(map(str.isspace, token.content))
    )


class ModelTokenizer:
    """The BPE, the chat template and the special tokens of one model directory."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        try:
            self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            config: dict[str, Any] = orjson.loads(
                (model_dir / "tokenizer_config.json").read_bytes()
            )
        except (OSError, Exception) as exc:  # tokenizers raises a bare Exception
            raise ValueError(f"cannot load a tokenizer from {model_dir}: {exc}") from None
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.config = config
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        self.special_tokens = {n: config[n] for n in names if isinstance(config.get(n), str)}
        image_token = config.get("image_token")
        self.image_token_id: int | None = (
            self._tokenizer.token_to_id(image_token) if isinstance(image_token, str) else None
        )
        """The image placeholder's id (a multimodal model: `image_token` in the config names
        an added token), else None: image parts are refused."""
        self.image_token = image_token if self.image_token_id is not None else None
        self.template = ChatTemplate(config["chat_template"], self.special_tokens, self.image_token)

    @functools.cached_property
    def _separator(self) -> tuple[str, int] | None:
        """An added token that strips nothing around it and is matched as it is written: texts
        joined by it encode as if each were encoded alone (checked on a probe), else None.
        Found on first use, not at load: encoding starts the library's thread pool unless the
        caller has set TOKENIZERS_PARALLELISM first (`gateway.events.prompts`)."""
        for token_id, token in sorted(self._tokenizer.get_added_tokens_decoder().items()):
            content = token.content
            if not content or token.normalized or not _plain(token):
                continue
            probe = ["Hello", " world\n", "  x", " 1 2", ""]
            joined = self.encode(content.join(probe))
            expected = [*self.encode(probe[0])]
            for text in probe[1:]:
                expected += [token_id, *self.encode(text)]
            if joined == expected:
                return content, token_id
        return None

    def added_tokens(self) -> list[str]:
        """The added tokens' texts (special tokens and the like): the tokenizer splits its
        input at these before anything else."""
        return [t.content for t in self._tokenizer.get_added_tokens_decoder().values()]

    def added_tokens_are_plain(self) -> bool:
        """Whether every added token is matched as written with no whitespace in it and
        strips nothing beside it: then a text cut at a space encodes piece by piece as it
        does whole around them (`gateway.events.words`)."""
        return all(map(_plain, self._tokenizer.get_added_tokens_decoder().values()))

    def encode(self, text: str) -> list[int]:
        """The token ids of `text` (`encode_batch_fast`: no offsets, ~1.5x faster)."""
        (encoding,) = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)
        ids: list[int] = encoding.ids
        return ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """The token ids of each text, in one call (the library parallelises a batch)."""
        return [
            e.ids for e in self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        ]

    def encode_pieces(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text, in one call to the BPE: the texts joined by an added token
        that strips nothing (`_separator`) and the ids cut at its id. ~4x cheaper than
        `encode_many` on a thousand words (the library's cost is per call, not per token).
        `encode_many` when the model has no such token or a text holds it."""
        separator = self._separator
        if separator is None or len(texts) < 2 or any(separator[0] in t for t in texts):
            return self.encode_many(texts)
        ids = self.encode(separator[0].join(texts))
        out = []
        start = 0
        for _ in range(len(texts) - 1):
            end = ids.index(separator[1], start)
            out.append(ids[start:end])
            start = end + 1
        out.append(ids[start:])
        return out

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included (vLLM's /detokenize)."""
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=False)
        return text

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of `ids` (vLLM's `token_strs`, byte-level spelling)."""
        return [self._tokenizer.id_to_token(i) or "" for i in ids]

    def render_chat(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of a chat request; raises `ChatTemplateError` for a malformed one."""
        return self.template.render(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )

    @staticmethod
    def chat_parts(body: Mapping[str, Any]) -> tuple[list[Any], list[Any] | None]:
        """A chat request's messages and tools, checked for shape (`ChatTemplateError`)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("'messages' must be a non-empty list")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ChatTemplateError("'tools' must be a list")
        return messages, tools

    def prompt_of(self, body: Mapping[str, Any], chat: bool) -> str | list[int]:
        """The text the engine tokenizes (a chat: its rendering), or a token-id prompt."""
        if chat:
            messages, tools = self.chat_parts(body)
            return self.render_chat(
                messages,
                tools,
                add_generation_prompt=chat_flag(body, "add_generation_prompt", True),
                continue_final_message=chat_flag(body, "continue_final_message", False),
            )
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return self.check_ids(prompt, "prompt")
        raise ChatTemplateError("'prompt' must be a string or a list of token ids")

    def with_images(
        self,
        ids: Sequence[int],
        body: Mapping[str, Any],
        chat: bool,
        tokens_per_image: int,
        identify: Callable[[Mapping[str, Any], str], str] = identify,
    ) -> tuple[Sequence[int], tuple[Placeholder, ...]]:
        """A prompt's ids as the engine caches them: each image's placeholder expanded into
        `tokens_per_image`, and each image's span with its identifier (`cachemap.multimodal`).
        A completion, a text-only model, or a chat without images: the ids as they are (a
        placeholder typed into a chat without images is a token like any other: no image, no
        extra key, on both sides). `identify`: an image part's identifier (the gateway's
        cache in front of `cachemap.multimodal.identify`)."""
        placeholder = self.image_token_id
        messages = body.get("messages")
        if not chat or placeholder is None or not has_parts(messages):
            return ids, ()
        assert isinstance(messages, list)
        identifiers = image_identifiers(messages, identify)
        if not identifiers:
            return ids, ()
        return expand(ids, placeholder, identifiers, tokens_per_image)

    def check_ids(self, ids: list[Any], name: str) -> list[int]:
        """`ids` when each is a token id of the vocabulary, else a `ChatTemplateError`."""
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size:
                raise ChatTemplateError(
                    f"'{name}' holds {i!r}, which is not a token id (0 .. {self.vocab_size - 1})"
                )
        return ids
