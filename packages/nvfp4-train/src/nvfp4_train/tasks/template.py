"""The simple Jinja that lm-evaluation-harness task YAMLs use, without Jinja: `{{ name }}`,
`{{ a.b }}` and `{{ a[0] }}` substitutions only, never evaluated as code.

Example:
    >>> render("Q: {{question}}\\nA:", {"question": "2+2?"}, "t.yaml")
    'Q: 2+2?\\nA:'
    >>> render("{{ choices.text }}", {"choices": {"text": ["a", "b"]}}, "t.yaml")
    ['a', 'b']
"""

from __future__ import annotations

import re
from typing import Any

from nvfp4_train.tasks.task_error import TaskError

PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}", re.S)
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


class TemplateError(TaskError):
    """A template this substitution does not read, or a name the document lacks."""


def render(template: str, doc: dict, where: str) -> Any:
    """`template` with each `{{ path }}` replaced by `doc`'s value at `path`.

    A template that is exactly one placeholder gives the value itself (a list stays a list, as
    lm-eval's `doc_to_choice: "{{choices}}"` does); otherwise values are substituted as text.

    Raises:
        TemplateError: Jinja control blocks (`{% %}`), comments (`{# #}`), filters or
            expressions, or a name `doc` does not have.
    """
    for marker, what in (("{%", "control block {% ... %}"), ("{#", "comment {# ... #}")):
        if marker in template:
            raise TemplateError(f"{where}: unsupported feature: Jinja {what} in {template!r}")
    whole = PLACEHOLDER.fullmatch(template.strip())
    if whole:
        return _lookup(whole.group(1), doc, where)
    return PLACEHOLDER.sub(lambda m: str(_lookup(m.group(1), doc, where)), template)


def _lookup(expression: str, doc: dict, where: str) -> Any:
    text = expression.strip()
    head = NAME.match(text)
    steps = list(STEP.finditer(text, head.end())) if head else []
    end = steps[-1].end() if steps else (head.end() if head else 0)
    if not head or end != len(text) or "".join(m.group(0) for m in steps) != text[head.end() :]:
        raise TemplateError(
            f"{where}: unsupported feature: Jinja expression {{{{{expression}}}}} (only "
            "{{ name }}, {{ a.b }} and {{ a[0] }})"
        )
    if head.group(0) not in doc:
        raise TemplateError(f"{where}: missing field {head.group(0)!r} (has {sorted(doc)})")
    value = doc[head.group(0)]
    for step in steps:
        attribute, index = step.groups()
        try:
            value = value[attribute] if attribute is not None else value[int(index)]
        except (KeyError, IndexError, TypeError):
            raise TemplateError(f"{where}: {text!r} is not in the document") from None
    return value
