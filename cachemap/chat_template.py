"""The engine's chat template, applied the way vLLM applies a Hugging Face chat template.

Two steps, as in vLLM's chat serving:

1. **Messages are parsed** (`prepare_messages`, vLLM's "string" content format): a content that
   is a list of parts becomes its text parts joined with "\\n" (a non-text part is refused by a
   text-only model; a multimodal one's `image_url` parts become its image placeholder, each on
   its own line before the text, as vLLM places them), null content becomes ""; an
   assistant's `tool_calls` keep only non-empty lists, and each call's `function.arguments`
   string is parsed as JSON (an empty one is `{}`), because templates render arguments with
   `tojson`.
2. **The template is rendered** (`ChatTemplate.render`, transformers' `apply_chat_template`
   with `tokenize=False`): jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and
   `lstrip_blocks`, the `loopcontrols` extension, a `raise_exception(message)` global, a
   `tojson` filter that does not escape HTML (`json.dumps(ensure_ascii=False)`, default
   spacing), `strftime_now`; the variables `messages`, `tools`, `add_generation_prompt`, and
   the special tokens (`eos_token`, `pad_token`, ...). With `continue_final_message` the
   rendering stops right after the final message's content (its last occurrence, stripped),
   so the model continues that message instead of starting a new one.

Errors are `ChatTemplateError` (a `ValueError`): a caller's malformed conversation, a 400.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the message says what is wrong with it."""


def _text_of(content: Any, where: str, image_token: str | None = None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(f"{where}: 'content' must be a string, null or a list of parts")
    texts: list[str] = []
    images = 0
    for part in content:
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{where}: each content part must be an object")
        kind = part.get("type")
        if kind == "image_url" and image_token is not None:
            images += 1
            continue
        if kind != "text":
            what = "this model" if image_token is not None else "this text-only model"
            raise ChatTemplateError(
                f"{where}: content part type {kind!r} is not supported by {what}; "
                "send text parts" + (" or image_url parts" if image_token is not None else "")
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}: a text part needs a string 'text'")
        texts.append(text)
    joined = "\n".join(texts)
    if image_token is None or not images:
        return joined
    # vLLM's "string" content format: a placeholder the text already holds stands for an
    # image; the missing ones go first, each on its own line
    missing = images - joined.count(image_token)
    if missing < 0:
        raise ChatTemplateError(
            f"{where}: the text holds more {image_token} placeholders than the part has images"
        )
    return "\n".join([image_token] * missing + [joined])


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}: 'tool_calls' must be a list")
    out: list[dict[str, Any]] = []
    for call in calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise ChatTemplateError(f"{where}: each tool call needs a 'function' object")
        function = dict(call["function"])
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError as exc:
                raise ChatTemplateError(
                    f"{where}: tool call arguments are not valid JSON: {exc}"
                ) from None
        out.append({**call, "function": function})
    return out


def prepare_messages(
    messages: Sequence[Any], image_token: str | None = None
) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as the template sees them (step 1 of the module docstring).
    `image_token`: the model's image placeholder (a multimodal model): each `image_url` part
    becomes one, as vLLM places them (`cachemap.multimodal`); None: image parts are refused."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}: 'role' must be a non-empty string")
        prepared = {
            **message,
            "role": role,
            "content": _text_of(message.get("content"), where, image_token),
        }
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = _tool_calls(message["tool_calls"], where)
            if calls:
                prepared["tool_calls"] = calls
            else:
                del prepared["tool_calls"]
        out.append(prepared)
    return out


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with `message.role` on a plain dict answered without raising.

    The sandbox's `getattr` tries the attribute first and falls back to the item, so every
    `message.content` in a template raised and caught an `AttributeError` (and a missing key a
    `KeyError` after it): a quarter of the two renders of a continuation's tail (40 against
    30 µs on this machine for a 300-word turn; py-spy found the sandbox's `getattr` in
    `kvgate bench-cpu --conversations`). A `dict` has no instance attributes, so where its type
    has no attribute of that name the base answer is the item or undefined; that answer is
    given directly. Anything else (a dict method's name, any other type) goes through the
    sandbox as before."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and not hasattr(dict, attribute):
            if attribute in obj:
                return obj[attribute]
            return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = _ChatEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str | None],
        image_token: str | None = None,
    ) -> None:
        try:
            self.template = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from None
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._globals = dict(self.template.globals)
        """The template's globals flattened once: `jinja2.Template.render` merges its `ChainMap`
        of them into every render's context (and again into the context's `globals_keys`), a
        Python step per global; that was ~40% of a continuation's two tail renders (py-spy,
        `kvgate bench-cpu --conversations`). The globals are set before compiling and never
        change after."""
        self.image_token = image_token
        """The image placeholder of a multimodal model (`prepare_messages`), else None."""

    def _render(self, variables: dict[str, Any]) -> str:
        """`jinja2.Template.render` over a context whose variables already hold the globals
        (`_globals`), so none is merged in again."""
        template = self.template
        environment = template.environment
        context = environment.context_class(environment, variables, template.name, template.blocks)
        try:
            return environment.concat(template.root_render_func(context))
        except Exception:
            environment.handle_exception()  # raises it again, its traceback the template's
            raise  # not reached

    def render(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of a chat request (see the module docstring)."""
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
        ):
            raise ChatTemplateError("'tools' must be a list of objects")
        conversation = prepare_messages(messages, self.image_token)
        try:
            rendered = self._render(
                {
                    **self._globals,
                    "messages": conversation,
                    "tools": tools or None,
                    "add_generation_prompt": add_generation_prompt,
                    **self.special_tokens,
                }
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"cannot render the chat template: {exc}") from None
        except (TypeError, AttributeError) as exc:  # e.g. a name that is not a string
            raise ChatTemplateError(f"malformed messages: {exc}") from None
        if continue_final_message:
            if not conversation:
                raise ChatTemplateError("continue_final_message needs a final message")
            content = conversation[-1]["content"]
            start = rendered.rfind(content.strip())
            if not content.strip() or start < 0:
                raise ChatTemplateError(
                    "continue_final_message: the final message's content is not in the prompt"
                )
            kept = content.lstrip()  # its trailing whitespace too, when the template kept it
            if rendered[start : start + len(kept)] != kept:
                kept = content.strip()
            rendered = rendered[: start + len(kept)]
        return rendered
