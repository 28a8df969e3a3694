"""Slack-compatible webhook posts (``{"text": ..., "mechmon": {...}}``) that never block training.

Standard library only, so the session (at an alarm) and ``mechmon-supervise`` (at each recovery
action) share it without pulling in torch. ``post`` queues the message for a daemon thread and
returns at once; the thread sends each message with a timeout and a bounded number of retries,
and drops it (one log line) when the server stays down. ``close(wait_s)`` gives the queue a
bounded time to drain, so a process that exits right after an alarm still sends it when it can.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)


def check_webhook_url(url: str) -> str:
    """``url`` when it is an http(s) URL, else ``ValueError`` (the caller names its flag)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) < 10:
        raise ValueError(f"must be an http:// or https:// URL, got {url!r}")
    return url


@dataclass(frozen=True)
class WebhookSettings:
    """How hard to try: each attempt waits at most ``timeout_s``; ``retries`` more attempts
    follow a failure, ``backoff_s`` apart (seconds)."""

    timeout_s: float = 3.0
    retries: int = 2
    backoff_s: float = 0.5


def send(url: str, payload: dict, settings: WebhookSettings = WebhookSettings()) -> bool:
    """POST ``payload`` as JSON now; True on a 2xx answer. Never raises."""
    try:
        body = json.dumps(payload, allow_nan=False, default=str).encode("utf-8")
    except ValueError as exc:  # a non-finite number: say so rather than send invalid JSON
        logger.warning("[mechmon] webhook message not sent: %s", exc)
        return False
    for attempt in range(settings.retries + 1):
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=settings.timeout_s) as answer:
                if 200 <= answer.status < 300:
                    return True
        except (urllib.error.URLError, OSError, ValueError) as exc:
            logger.info("[mechmon] webhook attempt %d failed: %s", attempt + 1, exc)
        if attempt < settings.retries:
            time.sleep(settings.backoff_s)
    logger.warning("[mechmon] webhook %s did not answer after %d attempts; message dropped", url,
                   settings.retries + 1)
    return False


class WebhookPoster:
    """Queue of messages for one URL, sent by a daemon thread (started at the first post)."""

    def __init__(self, url: str, settings: WebhookSettings = WebhookSettings(), max_queued: int = 32) -> None:
        self.url = check_webhook_url(url)
        self.settings = settings
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._thread: Optional[threading.Thread] = None
        self.sent = 0
        self.dropped = 0

    def post(self, payload: dict) -> None:
        """Queue ``payload``; returns at once (a full queue drops the message: never block)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mechmon-webhook", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1

    def close(self, wait_s: float = 2.0) -> None:
        """Wait at most ``wait_s`` seconds for the queued messages, then let the daemon go."""
        if self._thread is None:
            return
        deadline = time.monotonic() + wait_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)

    def _run(self) -> None:
        while True:
            payload = self._queue.get()
            try:
                if send(self.url, payload, self.settings):
                    self.sent += 1
                else:
                    self.dropped += 1
            finally:
                self._queue.task_done()
