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


def make_writable_folder(folder: str) -> None:
    """The output folder, made and written to once before a long run (not after, when its results would be
    lost); OSError says why it cannot be."""
    from pathlib import Path

    Path(folder).mkdir(parents=True, exist_ok=True)
    probe = Path(folder) / ".minipd-write-check"
    probe.write_text("")
    probe.unlink()


def server_url(text: str) -> str:
    """--url: a server's base URL, with its scheme (urllib reads "localhost:8000" as a scheme and a path)."""
    from urllib.parse import urlsplit

    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"must be a URL such as http://127.0.0.1:8000, got {text!r}")
    return text.strip()


server_url.__name__ = "a server URL"


def port_number(text: str) -> int:
    """0: any free port (the log says which)."""
    port = nonnegative_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 0 to 65535, got {text!r}")
    return port


port_number.__name__ = "a TCP port"


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
