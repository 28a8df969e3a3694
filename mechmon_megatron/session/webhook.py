"""Slack-compatible webhook posts (``{"text": ..., "mechmon": {...}}``) that never block training.

Standard library only, so the session (at an alarm) and ``mechmon-supervise`` (at each recovery
action) share it without pulling in torch. ``post`` queues the message for a daemon thread and
returns at once; the thread sends each message with a timeout and a bounded number of retries,
and drops it when the server stays down: the first drop is one warning naming the host and why,
later ones are counted and reported once by ``close(wait_s)``, which gives the queue a bounded
time to drain, so a process that exits right after an alarm still sends it when it can.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Optional

from mechmon_megatron.session.log import mechmon_log

log = mechmon_log(__name__)


def check_webhook_url(url: str) -> str:
    """``url`` when a post to it can be attempted, else ``ValueError`` (the caller names its flag).

    Parsed whole, once, where the front end reads it (``--mechmon-alert-webhook``, the DeepSpeed
    key ``alert_webhook``, ``mechmon-supervise --webhook``): scheme http or https, a host, a port
    that is a number in 1..65535 when one is given, ASCII without spaces or control characters. A URL that
    passes is one ``urllib`` can send to, so the poster built after the model never refuses it and
    an alarm is never dropped for a typo the user could have been told about at start-up.
    """
    problem = _url_problem(url)
    if problem:
        raise ValueError(f"must be an http:// or https:// URL with a host (e.g. https://hooks.example/x), got "
                         f"{url!r}: {problem}")
    return url


def _url_problem(url: object) -> Optional[str]:
    if not isinstance(url, str):
        return f"not a string ({type(url).__name__})"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "it holds a space or a control character"
    if not url.isascii():
        return "it holds a non-ASCII character (percent-encode it; an IDN host in its xn-- form)"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises ValueError on a port that is no number or out of range
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme or 'missing'!r}, not http or https"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    return None


@dataclass(frozen=True)
class WebhookSettings:
    """How hard to try: each attempt waits at most ``timeout_s``; ``retries`` more attempts
    follow a failure, ``backoff_s`` apart (seconds)."""

    timeout_s: float = 3.0
    retries: int = 2
    backoff_s: float = 0.5


def webhook_host(url: str) -> str:
    """The host (and port) of ``url``: what a log line names, never the path, which often holds
    the webhook's secret token (Slack's ``/services/T.../B.../...``)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname or "?", parts.port
    except ValueError:
        return "?"
    return f"{host}:{port}" if port is not None else host


def failure_reason(exc: BaseException, settings: WebhookSettings) -> str:
    """Why one attempt failed, in a few words: ``timed out after 3 s``, ``HTTP 503``,
    ``connection refused``, else the error's own text."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    cause: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(cause, TimeoutError) or (isinstance(cause, str) and "timed out" in cause):
        return f"timed out after {settings.timeout_s:g} s"
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    return str(cause) or type(cause).__name__


def deliver(url: str, payload: dict, settings: WebhookSettings = WebhookSettings()) -> Optional[str]:
    """POST ``payload`` as JSON now, with the retries of ``settings``; None once a 2xx answer
    came, else why not (the last attempt's reason). Never raises, logs nothing above debug: the
    caller decides what to say (:class:`WebhookPoster` says it once)."""
    try:
        body = json.dumps(payload, allow_nan=False, default=str).encode("utf-8")
    except ValueError as exc:  # a non-finite number: say so rather than send invalid JSON
        return f"not sent, not valid JSON: {exc}"
    reason = "no attempt"
    for attempt in range(settings.retries + 1):
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=settings.timeout_s) as answer:
                if 200 <= answer.status < 300:
                    return None
                reason = f"HTTP {answer.status}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = failure_reason(exc, settings)
        log.debug("webhook attempt %d to %s failed: %s", attempt + 1, webhook_host(url), reason)
        if attempt < settings.retries:
            time.sleep(settings.backoff_s)
    return reason


def send(url: str, payload: dict, settings: WebhookSettings = WebhookSettings()) -> bool:
    """POST ``payload`` as JSON now; True on a 2xx answer, else one warning naming the host and
    why. Never raises."""
    reason = deliver(url, payload, settings)
    if reason is not None:
        log.warning("webhook message not delivered to %s after %d attempt%s: %s", webhook_host(url),
                    settings.retries + 1, "" if settings.retries == 0 else "s", reason)
    return reason is None


class WebhookPoster:
    """Queue of messages for one URL, sent by a daemon thread (started at the first post).

    A message that is not delivered is never silent, and never noisy: the first failure is one
    warning naming the host and why (timed out, HTTP status, connection refused); later ones are
    counted, and :meth:`close` reports the count once, with the messages still unsent when the
    process stops waiting for them (an exit right after an alarm)."""

    def __init__(self, url: str, settings: WebhookSettings = WebhookSettings(), max_queued: int = 32) -> None:
        self.url = check_webhook_url(url)
        self.host = webhook_host(self.url)
        self.settings = settings
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.sent = 0
        self.dropped = 0
        """Messages given up: failed after every attempt, or refused by a full queue."""
        self.first_failure: Optional[str] = None
        self._reported = 0  # undelivered messages some line has told of
        self._closed = False

    def post(self, payload: dict) -> None:
        """Queue ``payload``; returns at once (a full queue drops the message: never block)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mechmon-webhook", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self._failed(f"{self._queue.maxsize} messages were already waiting (the queue was full)", attempted=False)

    def close(self, wait_s: float = 2.0) -> None:
        """Wait at most ``wait_s`` seconds for the queued messages, then let the daemon go; one
        warning when messages were not delivered that no line has told of yet."""
        if self._thread is None:
            return
        deadline = time.monotonic() + wait_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            self._closed = True
            pending = self._queue.unfinished_tasks
            undelivered = self.dropped + pending
            untold = undelivered - self._reported
            self._reported = undelivered
            why = [f"first: {self.first_failure}"] if self.first_failure else []
        if pending:
            why.append(f"{pending} still unsent after waiting {wait_s:g} s at the end")
        if untold > 0:
            log.warning("%d webhook message%s not delivered to %s (%s)", undelivered,
                        "" if undelivered == 1 else "s", self.host, "; ".join(why))

    def _failed(self, reason: str, attempted: bool = True) -> None:
        with self._lock:
            self.dropped += 1
            first = self.first_failure is None and not self._closed
            if self.first_failure is None:
                self.first_failure = reason
            if first:
                self._reported = 1
        if first:
            attempts = self.settings.retries + 1
            tried = f" after {attempts} attempt{'' if attempts == 1 else 's'}" if attempted else ""
            log.warning("webhook message not delivered to %s%s: %s; further failures are counted and "
                        "reported once at the end", self.host, tried, reason)

    def _run(self) -> None:
        while True:
            payload = self._queue.get()
            try:
                reason = deliver(self.url, payload, self.settings)
                if reason is None:
                    with self._lock:
                        self.sent += 1
                else:
                    self._failed(reason)
            finally:
                self._queue.task_done()
