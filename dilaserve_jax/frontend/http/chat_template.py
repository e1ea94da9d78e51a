"""The served checkpoint's chat template, rendered as Hugging Face's `apply_chat_template` does.

Where it comes from, first found: `chat_template.jinja` in the checkpoint directory (what recent
`transformers` saves), else `chat_template` in its `tokenizer_config.json` (a string, or a list of
`{name, template}` of which the one named "default" is used), as LLaDA-8B-Instruct and Dream ship
it. The embedded tiny model has its own `assets/tiny/chat_template.jinja`.

Rendering: Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
loopcontrols extension and a no-op `{% generation %}` tag, `raise_exception(message)`,
`strftime_now(format)` and a `tojson` that keeps non-ASCII text; the variables are `messages`,
`add_generation_prompt` (always true here), `tools`/`documents` (none), and the special tokens of
tokenizer_config.json (`bos_token`, `eos_token`, ...). A template that raises, or does not
compile, answers the chat call with a 400 naming why.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dilaserve_jax.frontend.http.errors import ApiError

log = logging.getLogger(__name__)
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF marks assistant text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render(caller):
        return caller()


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled template (or why there is none) and the special tokens it may use."""

    def __init__(self, text: str | None, special: dict[str, str], origin: str):
        self.origin, self.special, self.error = origin, special, None
        self._template = None
        if text is None:
            self.error = f"the served model has no chat template ({origin}): use /v1/completions"
            return
        try:
            self._template = _environment().from_string(text)
        except jinja2.TemplateError as err:
            self.error = f"the served model's chat template ({origin}) does not compile: {err}"
            log.warning("%s", self.error)

    @property
    def usable(self) -> bool:
        return self._template is not None

    def render(self, messages: list[dict]) -> str:
        if self._template is None:
            raise ApiError(400, f"messages: {self.error}", param="messages", code="no_chat_template")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                         **self.special)
        except Exception as err:  # noqa: BLE001 - raise_exception, or a template tripping over the input
            raise ApiError(400, f"messages: the chat template refused them: {err}", param="messages",
                           code="chat_template_error") from None


def model_directory(model_source: str) -> Path | None:
    """The checkpoint directory of a cluster's model source ("hf:DIR", "orbax:DIR@STEP"), if any."""
    kind, _, rest = model_source.partition(":")
    if kind == "hf":
        return Path(rest)
    if kind == "orbax":
        return Path(rest.rpartition("@")[0] or rest)
    return None


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_template(model_source: str) -> ChatTemplate:
    directory = model_directory(model_source)
    if directory is None:
        return ChatTemplate(None, {}, f"{model_source} is no checkpoint directory")
    config, special = {}, {}
    path = directory / CONFIG_FILE
    if path.exists():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            log.warning("%s unreadable: %s", path, err)
        if not isinstance(config, dict):
            config = {}
        special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    if (directory / TEMPLATE_FILE).exists():
        try:
            return ChatTemplate((directory / TEMPLATE_FILE).read_text(), special, str(directory / TEMPLATE_FILE))
        except OSError as err:
            return ChatTemplate(None, special, f"{directory / TEMPLATE_FILE} unreadable: {err}")
    text = config.get("chat_template")
    if isinstance(text, list):  # named templates
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
        text = named.get("default")
    if not isinstance(text, str):
        return ChatTemplate(None, special, f"neither {TEMPLATE_FILE} nor a chat_template in {CONFIG_FILE} "
                                           f"in {directory}")
    return ChatTemplate(text, special, str(path))


class Templates:
    """The template of whatever the cluster serves now (a reload may change it), read once per source."""

    def __init__(self, cluster):
        self.cluster = cluster
        self._source, self._template = None, None

    def current(self) -> ChatTemplate:
        source = self.cluster.model_source
        if source != self._source:
            self._template, self._source = load_template(source), source
        return self._template
