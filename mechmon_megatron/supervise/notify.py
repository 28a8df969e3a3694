"""Tell people about each recovery action (``--webhook URL``): Slack-compatible JSON."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from mechmon_megatron.session.webhook import WebhookPoster
from mechmon_megatron.supervise.records import RecoveryRecord


class Notifier:
    """Posts each record through a daemon thread (timeout, bounded retries; never blocks)."""

    def __init__(self, url: Optional[str]) -> None:
        self._poster = WebhookPoster(url) if url else None

    def record(self, record: RecoveryRecord) -> None:
        if self._poster is not None:
            body = {k: v for k, v in asdict(record).items() if k != "command"}
            self._poster.post({"text": record.line(), "mechmon": {"event": "recovery", **body}})

    def close(self, wait_s: float = 5.0) -> None:
        if self._poster is not None:
            self._poster.close(wait_s)
