"""Tokenizer and chat template, from GGUF metadata or an HF tokenizer directory.

A GGUF file carries a byte-level BPE vocabulary, its merges, the pre-tokenizer's name and the chat
template. We build a `tokenizers.Tokenizer` from those and save it in Hugging Face layout
(`tokenizer.json` + `tokenizer_config.json`), which is also what a safetensors model directory
brings, so one reader serves both and a saved copy makes the next start fast.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp's token types (gguf.TokenType): 3 is CONTROL (special), 4 USER_DEFINED (added).
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = None  # ByteLevel's own regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The pre-tokenizer names llama.cpp writes (`tokenizer.ggml.pre`), grouped by how they split text.
# The starcoder family (SmolLM among them) isolates every digit, then applies the GPT-2 split.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_PRE_TOKENIZERS: dict[str, tuple[bool, str | None]] = {
    "default": (False, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    **{name: (True, _GPT2_SPLIT) for name in _DIGITS_THEN_GPT2},
    **{name: (False, _LLAMA3_SPLIT) for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")},
    **{name: (False, _QWEN2_SPLIT) for name in ("qwen2", "deepseek-r1-qwen")},
}


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet: it writes each byte as one printable character, the printable
    Latin-1 bytes as themselves and the other 68 as the characters from U+0100 on, in byte
    order. Character to byte."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = (b for b in range(256) if b not in printable)
    chars = {chr(b): b for b in printable}
    chars.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()
# Past this many characters a text is tokenized (past a quarter of it in ids, detokenized)
# through the backend's batch call, which releases the GIL.
LONG_TEXT_CHARS = 16384


@dataclass(frozen=True, slots=True)
class GGUFTokenizerSpec:
    """The tokenizer fields of a GGUF file (`tokenizer.ggml.*` and `tokenizer.chat_template`)."""

    model: str
    pre: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str]
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


def build_backend_from_gguf(spec: GGUFTokenizerSpec) -> BackendTokenizer:
    """A byte-level BPE tokenizer equivalent to llama.cpp's for this vocabulary."""
    if spec.model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {spec.model!r} is not supported (only byte-level BPE, 'gpt2'); "
            "use an HF model directory with tokenizer.json instead"
        )
    if spec.pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {spec.pre!r} is not supported; known: {sorted(_PRE_TOKENIZERS)}"
        )
    vocab = {token: i for i, token in enumerate(spec.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in spec.merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))  # type: ignore[arg-type]
    split_digits, split = _PRE_TOKENIZERS[spec.pre]
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    by_type = list(zip(spec.tokens, spec.token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in by_type if kind == _CONTROL]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in by_type
            if kind == _USER_DEFINED
        ]
    )
    return backend


class Tokenizer:
    """Text to token ids and back, plus the model's chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._template: Any = None
        self._takes_tools: bool | None = None  # read from the template on first use

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def added_token_id(self, text: str) -> int | None:
        """The id of the token added to the vocabulary (special or not) whose text is `text`."""
        for token_id, token in self.backend.get_added_tokens_decoder().items():
            if token.content == text:
                return int(token_id)
        return None

    def is_special(self, token_id: int) -> bool:
        """Whether decoding leaves the token out by default (`skip_special_tokens`)."""
        token = self.backend.get_added_tokens_decoder().get(token_id)
        return token is not None and bool(token.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which may be part of a UTF-8 character (its text
        alone then decodes to U+FFFD)."""
        piece = self.token_text(token_id)
        if isinstance(self.backend.decoder, decoders.ByteLevel) and all(
            c in _BYTE_OF_CHAR for c in piece
        ):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognized. A long text
        goes through `encode_batch`, which gives the same ids and lets other Python threads run
        meanwhile (`encode` holds the GIL: a router's event loop would stop for a second at a
        2 MB prompt)."""
        if len(text) > LONG_TEXT_CHARS:
            encoded = self.backend.encode_batch([text], add_special_tokens=False)[0]
        else:
            encoded = self.backend.encode(text, add_special_tokens=False)
        ids: list[int] = encoded.ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if len(ids) > LONG_TEXT_CHARS // 4:  # as `encode`: the batch call lets threads run
            return str(self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0])
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation (`[{"role": ..., "content": ...}, ...]`); `tools`
        (OpenAI's function definitions) reach templates that take them (`takes_tools`), and
        `template_kwargs` are further variables for the template (`enable_thinking`, say).
        With `continue_final_message` the text ends where the last message's content does,
        without the end of its turn, so that generation continues it."""
        final = ""
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message excludes add_generation_prompt")
            final = str(messages[-1].get("content") or "") if messages else ""
            if not final.strip():
                raise ValueError("continue_final_message needs a last message with text")
        template = self._compiled()
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        context: dict[str, Any] = {
            **(template_kwargs or {}),
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.token_text(self.bos_token_id),
            "eos_token": self.token_text(eos),
        }
        if tools:
            context["tools"] = list(tools)
        text = str(template.render(**context))
        return _up_to(text, final) if continue_final_message else text

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders `tools` (and so, by the convention of such
        templates, the conversation's tool calls and tool results) itself."""
        if not self.chat_template:
            return False
        if self._takes_tools is None:
            ast = _template_env().parse(self.chat_template)
            self._takes_tools = "tools" in jinja2.meta.find_undeclared_variables(ast)
        return self._takes_tools

    def _compiled(self) -> Any:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain completion prompt")
        if self._template is None:
            self._template = _template_env().from_string(self.chat_template)
        return self._template

    @classmethod
    def from_gguf_spec(cls, spec: GGUFTokenizerSpec) -> Tokenizer:
        eos = [t for t in (spec.eos_token_id, spec.eot_token_id) if t is not None]
        return cls(
            build_backend_from_gguf(spec),
            bos_token_id=spec.bos_token_id,
            eos_token_ids=list(dict.fromkeys(eos)),
            add_bos_token=spec.add_bos_token,
            chat_template=spec.chat_template,
        )

    def save(self, directory: Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (Hugging Face layout)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {
            "bos_token": self.token_text(self.bos_token_id) or None,
            "eos_token": self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else None,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
            "outrider_eos_token_ids": list(self.eos_token_ids),
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    @classmethod
    def from_directory(cls, directory: Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Read an HF tokenizer directory (ours, or one that came with a model)."""
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        backend = BackendTokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        bos = _token_id(backend, config.get("bos_token"))
        eos = list(config.get("outrider_eos_token_ids") or eos_token_ids)
        if not eos and (eos_id := _token_id(backend, config.get("eos_token"))) is not None:
            eos = [eos_id]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template if isinstance(template, str) else None,
        )


def _token_id(backend: BackendTokenizer, token: Any) -> int | None:
    if isinstance(token, dict):  # older configs spell AddedToken as a dict
        token = token.get("content")
    if not token:
        return None
    token_id = backend.token_to_id(token)
    return None if token_id is None else int(token_id)


def _up_to(text: str, final: str) -> str:
    """`text` cut after the last place it shows `final` (as written, or stripped as templates
    often write a message's content)."""
    for shown in (final, final.strip()):
        end = text.rfind(shown)
        if end >= 0:
            return text[: end + len(shown)]
    raise ValueError("the chat template does not show the last message's text: cannot continue it")


def _template_env() -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    return env
