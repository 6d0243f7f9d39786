"""Log set-up shared by the gateway and the workers: text lines or one JSON object a line.

A record may carry structured `fields` (`log.info("access", extra={"fields": {...}})`): the
text format appends them as `key=value` pairs, the JSON format as keys of the object, so log
pipelines (Loki, Elasticsearch, Cloud Logging) index them without parsing.
"""

import argparse
import json
import logging
import re
import time

LOG_FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(name)s %(message)s"
_QUOTE = re.compile(r'[ "=]')  # a value holding one of these is JSON-quoted


def logfmt(fields: dict) -> str:
    """`key=value` pairs; values with spaces, quotes or `=` are JSON-quoted."""
    parts = []
    for k, v in fields.items():
        if v is None:
            continue
        s = f"{v:.1f}" if isinstance(v, float) else str(v)
        if not s or _QUOTE.search(s):
            s = json.dumps(s)
        parts.append(f"{k}={s}")
    return " ".join(parts)


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        return f"{line} {logfmt(fields)}" if fields else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error", "critical"],
        help="the lowest level logged (stderr)",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines, or one JSON object a line (structured fields as keys)",
    )


def setup_logging(level: str, fmt: str = "text") -> None:
    """Root handler on stderr in `fmt`, at `level`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
