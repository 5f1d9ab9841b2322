"""Help text that shows every option's default, as argparse's ArgumentDefaultsHelpFormatter does,
except where there is none to show (None, False) or the help already says it."""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)
