"""Renders chat templates the way Hugging Face transformers does, as the
judge of the worker's minijinja environment (worker/tests/chat_templates.rs).

The environment copies transformers' `_compile_jinja_template`
(transformers/utils/chat_template_utils.py): an ImmutableSandboxedEnvironment
with trim_blocks, lstrip_blocks, the loopcontrols extension and the
`{% generation %}` tag (AssistantTracker, which renders its body unchanged
when no assistant mask is asked for); `tojson` overridden by json.dumps with
ensure_ascii=False; globals `raise_exception` and `strftime_now`. The render
passes what `apply_chat_template` passes: messages, tools=None,
documents=None, add_generation_prompt, and the special tokens.

stdin: a JSON list of cases, each
  {"template": SOURCE, "messages": [...], "add_generation_prompt": BOOL,
   "bos_token": STR, "eos_token": STR, "now": "YYYY-MM-DDTHH:MM:SS"}
stdout: a JSON list, one entry per case: {"text": STR} or {"error": STR}.
`now` fixes the clock of strftime_now, so both renderers see the same date.
"""

import json
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class AssistantTracker(Extension):
    """transformers' `{% generation %}` tag, without mask tracking: the
    body renders as if the tag were not there."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def compile_template(source, now):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return now.strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[AssistantTracker, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render(case):
    now = datetime.fromisoformat(case["now"])
    try:
        template = compile_template(case["template"], now)
        text = template.render(
            messages=case["messages"],
            tools=None,
            documents=None,
            add_generation_prompt=case["add_generation_prompt"],
            bos_token=case["bos_token"],
            eos_token=case["eos_token"],
        )
        return {"text": text}
    except Exception as e:  # the judge reports every failure, of any kind
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    cases = json.load(sys.stdin)
    # ASCII on the pipe: no dependence on the locale's encoding.
    json.dump([render(c) for c in cases], sys.stdout, ensure_ascii=True)


if __name__ == "__main__":
    main()
