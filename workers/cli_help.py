"""`--help` that states every flag's default, shared by all `kvgate` commands."""

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and each flag's help followed by "(default: X)" where it has a
    default to show: argparse's ArgumentDefaultsHelpFormatter leaves out help-less flags and
    prints "default: None"; a help text that already names its default (an environment
    variable, say, whose value may be a secret) is left as it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default is None
            or default is False
            or default == []
            or default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
