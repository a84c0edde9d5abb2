"""Reading the user model's structured answers.

The parser is lenient about layout (full-width colons, Markdown bold, brackets
around the number, full-width digits and signs, the value on the next line) and
strict about content: an answer without a `Change:` field, or whose field holds
no integer ("slightly negative", "minus five"), is a parse failure that the
simulator re-asks a bounded number of times. As in SAGE, the change is the
first signed integer after the label. An answer that is a JSON object (the
`json_schema` response format) is read by its keys instead of its labels.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass


class ParseFailure(ValueError):
    """The answer lacks a required field or its value cannot be read."""


PLANNING_FIELDS = ("Content", "TargetCompletion", "Activity", "Analyse", "Change")
REPLY_FIELDS = ("Thinking", "Origin", "Change", "Response")

# A label at the start of a line, optionally decorated: "**Change:**", "- Change：", "[Change]:".
_LABEL = r"^[ \t>*#\-\[【]*({names})[ \t*\]】]*[:：]"
_INTEGER = re.compile(r"([+-]?)\s*(\d+)")
_QUOTES = "\"'“”‘’「」『』"


@dataclass(frozen=True)
class Planning:
    """The planning step's fields; `change` is the raw signed change the model gave."""

    content: str
    target_completion: str
    activity: str
    analyse: str
    change: int
    text: str  # the whole answer, as the model gave it (kept for the record)

    def feedback(self, template: str) -> str:
        """What the reply step is told: fit, inner reaction and feeling; not `Content` or `Change`."""
        return template.format(
            target_completion=self.target_completion.strip(),
            activity=self.activity.strip(),
            analyse=self.analyse.strip(),
        )

    def record(self, applied: float) -> dict[str, object]:
        """The SAGE `planning` record (their key spellings), with the change actually applied."""
        return {
            "content": self.content,
            "TargetCompletion": self.target_completion,
            "activity": self.activity,
            "analyse": self.analyse,
            "change": applied,
            "raw_change": self.change,
        }


@dataclass(frozen=True)
class UserReply:
    thinking: str
    response: str


def _normalise(text: str) -> str:
    # NFKC folds full-width digits and plus signs; the minus signs need mapping. Only the
    # change value is normalised: the user's own words keep their punctuation.
    text = unicodedata.normalize("NFKC", text)
    return text.replace("\u2212", "-").replace("\u2013", "-").replace("\u2014", "-")


# JSON keys (lower case, no underscores) -> field labels. The reply's "Change:" (how the
# draft was revised) is "revision" in JSON so it cannot be mistaken for an emotion change.
_JSON_KEYS = {
    "content": "Content",
    "targetcompletion": "TargetCompletion",
    "activity": "Activity",
    "analyse": "Analyse",
    "analysis": "Analyse",
    "change": "Change",
    "thinking": "Thinking",
    "origin": "Origin",
    "revision": "Change",
    "response": "Response",
}


def _json_fields(text: str, names: tuple[str, ...]) -> dict[str, str] | None:
    """The fields of an answer that is one JSON object (optionally in a code fence), else None."""
    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    if not body.startswith("{"):
        return None
    try:
        record = json.loads(body)
    except json.JSONDecodeError as error:
        raise ParseFailure(f"the answer is not valid JSON ({error.msg})") from None
    if not isinstance(record, dict):
        return None
    fields: dict[str, str] = {}
    for key, value in record.items():
        name = _JSON_KEYS.get(str(key).lower().replace("_", ""))
        if name in names and value is not None:
            fields.setdefault(name, str(value).strip())
    return fields


def split_fields(text: str, names: tuple[str, ...]) -> dict[str, str]:
    """Map each label found at a line start to the text up to the next label (first one wins)."""
    from_json = _json_fields(text, names)
    if from_json is not None:
        return from_json
    pattern = re.compile(_LABEL.format(names="|".join(names)), re.IGNORECASE | re.MULTILINE)
    matches = list(pattern.finditer(text))
    fields: dict[str, str] = {}
    canonical = {name.lower(): name for name in names}
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        name = canonical[match.group(1).lower()]
        fields.setdefault(name, text[match.end() : end].strip())
    return fields


def parse_change(value: str) -> int:
    match = _INTEGER.search(_normalise(value))
    if match is None:
        shown = value.strip().splitlines()[0][:40] if value.strip() else "nothing"
        raise ParseFailure(f"'Change:' must be followed by a signed integer, got {shown!r}")
    sign, digits = match.groups()
    return -int(digits) if sign == "-" else int(digits)


# The one layout strict parsing accepts: "Change: +4" on its own line, ASCII colon and digits.
_STRICT_CHANGE = re.compile(r"^Change: ?[+-]?[0-9]+\s*$", re.MULTILINE)


def parse_planning(text: str, *, strict: bool = False) -> Planning:
    """Read a planning answer; `strict` re-asks anything but `Change: <signed integer>`."""
    fields = split_fields(text, PLANNING_FIELDS)
    if "Change" not in fields:
        raise ParseFailure("the 'Change:' field is missing")
    if strict and not text.lstrip().startswith("{") and not _STRICT_CHANGE.search(text):
        raise ParseFailure("the change must be written exactly as 'Change: <signed integer>' on its own line")
    return Planning(
        content=fields.get("Content", ""),
        target_completion=fields.get("TargetCompletion", ""),
        activity=fields.get("Activity", ""),
        analyse=fields.get("Analyse", ""),
        change=parse_change(fields["Change"]),
        text=text.strip(),
    )


def parse_reply(text: str) -> UserReply:
    fields = split_fields(text, REPLY_FIELDS)
    if "Response" not in fields:
        raise ParseFailure("the 'Response:' field is missing")
    response = fields["Response"].strip().strip(_QUOTES).strip()
    if not response:
        raise ParseFailure("the 'Response:' field is empty")
    return UserReply(thinking=fields.get("Thinking", ""), response=response)
