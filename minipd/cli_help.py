"""Help text that shows every option's default, as argparse's ArgumentDefaultsHelpFormatter does,
except where the help already says it; an option without one says "none" (flags: off, unsaid)."""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is False or action.default is argparse.SUPPRESS or action.required or "default" in text:
            return text
        if action.default is None:
            return f"{text} (default: none)" if action.option_strings and action.nargs != 0 else text
        return super()._get_help_string(action)


def _number(kind, low: float, strict: bool, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value != value or value in (float("inf"), float("-inf")) or (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in its message
    return parse


positive_int = _number(int, 0, True, "an integer >= 1")
nonnegative_int = _number(int, 0, False, "an integer >= 0")
positive_float = _number(float, 0, True, "a number > 0")
nonnegative_float = _number(float, 0, False, "a number >= 0")


def listed(item, inf: bool = False):
    """A comma-separated list of `item`s, checked; returned as the text given (callers split it).
    inf: "inf" is one of the values allowed."""

    def parse(text: str) -> str:
        parts = text.split(",")
        for part in parts:
            if not (inf and part.strip().lower() == "inf"):
                item(part.strip())
        return text

    parse.__name__ = f"a comma-separated list ({item.__name__} each)"
    return parse
