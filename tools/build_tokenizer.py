"""Build the simulated engine's tokenizer (`loadgen/engine/model/`), or check it has not drifted.

The model directory is what a Hugging Face loader (and a gateway that wants "the model's
tokenizer") reads: `tokenizer.json` (a byte-level BPE in the `tokenizers` format) and
`tokenizer_config.json` (special tokens, `added_tokens_decoder`, and the chat template, copied
from `chat_template.jinja`, which is the template's source).

The BPE is trained on text generated here, deterministically, so the same bytes come out of
every run (`python -m tools.build_tokenizer --check`, and `tests/tools/test_tokenizer_build.py`,
compare a fresh build with the committed files, tokenizer.json by what it tokenizes, so a
`tokenizers` release that serializes differently is no drift; `make tokenizer` rewrites them):
- a lexicon of pseudo-words built from syllables (seeded `random.Random`), plus the English
  words a chat template and an agent's prompt are made of, in sentences whose word
  frequencies fall off as a Zipf law, so the frequent words end up as single tokens;
- chat requests rendered with the engine's own template (tools, system prompts, tool calls and
  results; the added tokens cut out, as encoding cuts them), JSON tool definitions (in
  `tojson`'s spacing), headings ("Task:"), letters separated by spaces (so " X" is one token for
  every letter, as in real vocabularies: the timing audit's prompts count on it), code-like
  lines and numbers, so prompts with tools tokenize about as compactly as a real model's would.
The pre-tokenizer is GPT-2's byte-level split (a leading space belongs to the word after it;
merges never cross a pre-token), with Qwen's ChatML special tokens added after the BPE
vocabulary, as Qwen numbers them.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import re
import string
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "loadgen" / "engine" / "model"
TEMPLATE_FILE = "chat_template.jinja"

SEED = 20_261_201
"""The corpus generator's seed: change it and every token id changes."""
BPE_VOCAB_SIZE = 4_089
"""Byte alphabet (256) + merges; with the 8 added tokens the vocabulary is 4,097 ids: a few
thousand keeps tokenizer.json small, and is enough for ~2,000 whole-word tokens."""
NUM_PSEUDO_WORDS = 3_000
NUM_CONVERSATIONS = 4_000
NUM_SENTENCES = 30_000
NUM_HEADINGS = 8_000
NUM_LETTER_LINES = 2_000
NUM_TOOL_DOCUMENTS = 1_500
NUM_CODE_LINES = 6_000
MAX_MODEL_LEN = 131_072
"""The engine's default context (loadgen.engine.server.DEFAULT_MAX_MODEL_LEN)."""

# (content, special): ids follow the BPE vocabulary in this order
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<|image_pad|>", True),
)
IMAGE_TOKEN = "<|image_pad|>"
"""The image placeholder (Qwen2-VL's name): each image of a chat renders as one, which the
engine expands into `--mm-tokens-per-image` of them (cachemap.multimodal); the config names it
as `image_token`, as multimodal processors' configs do."""

_ENGLISH_TEXT = (
    "the of and to in is that for it as with was on be by this are from at or an have not but "
    "which one all were can there been has their more if will would about so what when up out "
    "into them some could time these two may then do first any my now such like our over me "
    "even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make "
    "world still own see work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right "
    "used take three you are a helpful assistant agent coding task project file tool tools "
    "function functions call calls result results name arguments argument type object "
    "properties property string number integer boolean array description parameters required "
    "path line lines read write run test tests search code change diff error value return "
    "values plan step steps user query request response may more these help inside signatures "
    "write json its tags xml signature system message content reply answer please thanks sure "
    "here done check fix add remove update open close list find show need want use using "
    "build"
)
ENGLISH = tuple(_ENGLISH_TEXT.split())
"""The English words of chat templates and agents' prompts (the most frequent ranks)."""

_ONSETS_TEXT = (
    "b c d f g h j k l m n p r s t v w z br cr dr fr gr pr tr st sp sl pl bl cl fl gl ch sh th"
)
ONSETS = tuple(_ONSETS_TEXT.split())
VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ou", "oo", "ie")
CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck")
HEADINGS = (
    "Task",
    "Subtask",
    "Plan",
    "Context",
    "Project file",
    "Tool result",
    "Result",
    "Error",
    "Output",
    "Input",
    "Question",
    "Answer",
    "Summary",
    "Note",
    "Example",
    "Instructions",
    "Hello",
    "Please",
    "Thanks",
    "User",
    "Assistant",
)
PUNCTUATION = (". ", ". ", ". ", "? ", "! ", ", ", "; ", ": ")


class _Draw:
    """Deterministic choices from one seeded generator (only `random()` is used, whose
    sequence Python keeps stable across versions)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def index(self, n: int) -> int:
        return int(self.rng.random() * n)

    def pick(self, items: Sequence[str]) -> str:
        return items[self.index(len(items))]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p


def pseudo_words(draw: _Draw, n: int) -> list[str]:
    """`n` distinct lowercase words of 1-3 syllables."""
    out: list[str] = []
    seen = set(ENGLISH)
    while len(out) < n:
        syllables = 1 + draw.index(3)
        word = "".join(
            draw.pick(ONSETS) + draw.pick(VOWELS) + draw.pick(CODAS) for _ in range(syllables)
        )
        if word not in seen and len(word) <= 10:
            seen.add(word)
            out.append(word)
    return out


class _Lexicon:
    """Words drawn with Zipf-like frequencies (weight of rank r ∝ 1 / (r + 10)^0.6)."""

    def __init__(self, draw: _Draw, words: Sequence[str]) -> None:
        self.draw = draw
        self.words = list(words)
        self.cumulative: list[float] = []
        total = 0.0
        for rank in range(len(self.words)):
            total += 1.0 / (rank + 10) ** 0.6
            self.cumulative.append(total)

    def word(self) -> str:
        x = self.draw.rng.random() * self.cumulative[-1]
        return self.words[min(bisect.bisect(self.cumulative, x), len(self.words) - 1)]

    def sentence(self) -> str:
        words = [self.word() for _ in range(4 + self.draw.index(16))]
        if self.draw.chance(0.8):
            words[0] = words[0].capitalize()
        if self.draw.chance(0.15):
            words.insert(1 + self.draw.index(len(words)), str(self.draw.index(2000)))
        return " ".join(words) + self.draw.pick(PUNCTUATION)


def _identifier(lexicon: _Lexicon) -> str:
    return "_".join(lexicon.word() for _ in range(1 + lexicon.draw.index(3)))


def _tool_definition(lexicon: _Lexicon) -> str:
    """One OpenAI tool definition, as the template's `tojson` writes it."""
    draw = lexicon.draw
    properties = {
        _identifier(lexicon): {
            "type": draw.pick(("string", "integer", "number", "boolean", "array")),
            "description": lexicon.sentence().strip(),
        }
        for _ in range(1 + draw.index(4))
    }
    tool = {
        "type": "function",
        "function": {
            "name": _identifier(lexicon),
            "description": lexicon.sentence().strip(),
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": sorted(properties)[:1],
            },
        },
    }
    return json.dumps(tool, ensure_ascii=False)


def _code_line(lexicon: _Lexicon) -> str:
    draw = lexicon.draw
    indent = "    " * draw.index(4)
    a, b = _identifier(lexicon), _identifier(lexicon)
    forms = (
        f"def {a}({b}, {lexicon.word()}):",
        f"{a} = {b}.{lexicon.word()}({draw.index(100)})",
        f"return {a} + {draw.index(10)}",
        f'if {a} is None: raise ValueError("{lexicon.sentence().strip()}")',
        f"for {a} in {b}:",
        f"# {lexicon.sentence().strip()}",
        f'{a}["{b}"] = {draw.index(1000) / 10}',
    )
    return indent + draw.pick(forms) + "\n"


def _conversation(lexicon: _Lexicon) -> dict[str, Any]:
    """A chat request: maybe tools, a system prompt, turns with tool calls and results."""
    draw = lexicon.draw
    tools = [json.loads(_tool_definition(lexicon)) for _ in range(draw.index(3))]
    messages: list[dict[str, Any]] = []
    if draw.chance(0.7):
        messages.append({"role": "system", "content": lexicon.sentence().strip()})
    for _ in range(1 + draw.index(4)):
        messages.append({"role": "user", "content": _paragraph(lexicon)})
        if tools and draw.chance(0.5):
            name = tools[draw.index(len(tools))]["function"]["name"]
            arguments = json.dumps({_identifier(lexicon): lexicon.word()})
            call = {"id": "call_" + lexicon.word(), "type": "function"}
            call["function"] = {"name": name, "arguments": arguments}  # type: ignore[assignment]
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append({"role": "tool", "content": _paragraph(lexicon)})
        messages.append({"role": "assistant", "content": _paragraph(lexicon)})
    return {"messages": messages, "tools": tools or None}


def _paragraph(lexicon: _Lexicon) -> str:
    return "".join(lexicon.sentence() for _ in range(1 + lexicon.draw.index(3))).strip()


def corpus(seed: int = SEED) -> Iterator[str]:
    """The training text, in pieces; the same seed gives the same pieces."""
    from cachemap.chat_template import ChatTemplate

    draw = _Draw(seed)
    lexicon = _Lexicon(draw, [*ENGLISH, *pseudo_words(draw, NUM_PSEUDO_WORDS)])
    template = ChatTemplate((MODEL_DIR / TEMPLATE_FILE).read_text(), {})
    # added tokens are cut out of the text before the BPE sees it, so train on what is between
    added = re.compile("|".join(re.escape(content) for content, _ in ADDED_TOKENS))
    for _ in range(NUM_CONVERSATIONS):
        chat = _conversation(lexicon)
        yield from added.split(template.render(chat["messages"], chat["tools"]))
    for i in range(NUM_SENTENCES):
        yield _paragraph(lexicon) + ("\n\n" if i % 7 == 0 else "\n")
    for _ in range(NUM_HEADINGS):  # "Task:", "Project file:" at the start of a line
        heading = draw.pick(HEADINGS)
        yield "\n" + heading + ":" + (" " + lexicon.sentence() if draw.chance(0.5) else "\n")
    for _ in range(NUM_LETTER_LINES):  # initials, and the timing audit's random-letter prompts
        yield " ".join(draw.pick(string.ascii_letters) for _ in range(20)) + "\n"
    for _ in range(NUM_TOOL_DOCUMENTS):
        yield _tool_definition(lexicon) + "\n"
    for _ in range(NUM_CODE_LINES):
        yield _code_line(lexicon)


def build_tokenizer_json(seed: int = SEED) -> str:
    """tokenizer.json: the BPE trained on `corpus(seed)`, with the added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer)
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    text: str = tokenizer.to_str(pretty=True)
    return text + "\n"


def build_tokenizer_config(tokenizer_json: str) -> str:
    """tokenizer_config.json, in the layout Qwen's model repositories use."""
    added = json.loads(tokenizer_json)["added_tokens"]
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token["id"]): {
                "content": token["content"],
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": token["special"],
            }
            for token in added
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": (MODEL_DIR / TEMPLATE_FILE).read_text(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "image_token": IMAGE_TOKEN,
        "model_max_length": MAX_MODEL_LEN,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"


def build() -> dict[str, str]:
    """File name (in MODEL_DIR) → content of every generated file."""
    tokenizer_json = build_tokenizer_json()
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": build_tokenizer_config(tokenizer_json),
    }


def tokenization_of(tokenizer_json: str) -> dict[str, Any]:
    """What decides how a tokenizer.json tokenizes (vocabulary, merges, added tokens, pre- and
    post-processing), without the serialization details a `tokenizers` release may change
    (merges as "a b" strings or pairs, new fields at their defaults)."""
    data = json.loads(tokenizer_json)
    model = data["model"]
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]
    added = [(t["id"], t["content"], t["special"]) for t in data["added_tokens"]]
    keys = ("normalizer", "pre_tokenizer", "post_processor", "decoder")
    options = ("ignore_merges", "byte_fallback", "dropout", "unk_token", "fuse_unk")
    return {
        "model": (model["type"], model["vocab"], merges, [model.get(o) for o in options]),
        "added_tokens": added,
        **{key: data.get(key) for key in keys},
    }


def drift(built: dict[str, str], model_dir: Path = MODEL_DIR) -> list[str]:
    """The generated files whose committed content differs from `built` (tokenizer.json: in
    what it tokenizes, see `tokenization_of`)."""
    changed = []
    for name, text in sorted(built.items()):
        path = model_dir / name
        if not path.is_file():
            changed.append(name)
        elif name == "tokenizer.json":
            if tokenization_of(path.read_text()) != tokenization_of(text):
                changed.append(name)
        elif path.read_text() != text:
            changed.append(name)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.build_tokenizer", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = parser.parse_args(argv)
    built = build()
    changed = drift(built)
    names = ", ".join(changed)
    if not changed:
        print(f"{MODEL_DIR.relative_to(REPO)} up to date ({', '.join(sorted(built))})")
        return 0
    if args.check:
        print(f"{MODEL_DIR.relative_to(REPO)} drifted from a fresh build: {names}")
        print("run `make tokenizer` and commit the result")
        return 1
    for name in changed:
        (MODEL_DIR / name).write_text(built[name])
    print(f"wrote {names} into {MODEL_DIR.relative_to(REPO)}; commit them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
