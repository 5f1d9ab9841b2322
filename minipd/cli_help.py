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
