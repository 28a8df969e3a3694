"""A webhook message that is not delivered is reported: the first failure at once (host and why),
later ones counted and reported once at close -- against real HTTP on 127.0.0.1."""

from __future__ import annotations

import logging
import sys
import urllib.parse
from pathlib import Path

import pytest

from mechmon_megatron.session.webhook import WebhookPoster, WebhookSettings
from tests.supervise._helpers import FAKE_HOST, Hook, closed_port_url, supervise

FAST = WebhookSettings(timeout_s=0.3, retries=0, backoff_s=0.0)


def _host(url: str) -> str:
    return f"127.0.0.1:{urllib.parse.urlsplit(url).port}"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "webhook" in r.getMessage()]


def test_a_server_that_answers_too_late_is_reported_once_then_counted_at_close(caplog):
    caplog.set_level(logging.INFO, logger="mechmon_megatron.session.webhook")
    with Hook(delay_s=1.5) as hook:
        poster = WebhookPoster(hook.url, FAST)
        for k in range(3):
            poster.post({"text": f"m{k}"})
        poster.close(wait_s=10.0)
        assert len(hook.bodies) == 3  # each reached the server, which answered too late
    host = _host(hook.url)
    assert _warnings(caplog) == [
        f"[mechmon] webhook message not delivered to {host} after 1 attempt: timed out after 0.3 s; further "
        "failures are counted and reported once at the end",
        f"[mechmon] 3 webhook messages not delivered to {host} (first: timed out after 0.3 s)",
    ]
    assert poster.dropped == 3 and poster.sent == 0
    assert "/hook" not in caplog.text  # the path (a webhook's secret token) is never logged
    poster.close(wait_s=0.1)
    assert len(_warnings(caplog)) == 2  # told once


@pytest.mark.parametrize("server", ["refused", "http-503"])
def test_one_failure_is_one_line_naming_the_reason(caplog, server):
    if server == "refused":
        url = closed_port_url()
        poster = WebhookPoster(url, FAST)
        poster.post({"text": "lost"})
        poster.close(wait_s=5.0)
        reason = "connection refused"
    else:
        with Hook(status=503) as hook:
            url = hook.url
            poster = WebhookPoster(url, WebhookSettings(timeout_s=2.0, retries=1, backoff_s=0.05))
            poster.post({"text": "lost"})
            poster.close(wait_s=5.0)
        reason = "HTTP 503"
    attempts = "1 attempt" if server == "refused" else "2 attempts"
    assert _warnings(caplog) == [
        f"[mechmon] webhook message not delivered to {_host(url)} after {attempts}: {reason}; further failures are "
        "counted and reported once at the end"
    ]


def test_messages_still_unsent_at_close_are_reported(caplog):
    with Hook(delay_s=2.0) as hook:
        poster = WebhookPoster(hook.url, WebhookSettings(timeout_s=5.0, retries=0))
        poster.post({"text": "slow"})
        poster.close(wait_s=0.3)
    assert _warnings(caplog) == [
        f"[mechmon] 1 webhook message not delivered to {_host(hook.url)} (1 still unsent after waiting 0.3 s at "
        "the end)"
    ]


def test_the_supervisor_reports_its_undelivered_posts(tmp_path: Path):
    """mechmon-supervise --webhook posts through the same poster (supervise/notify.py)."""
    save = tmp_path / "ck"
    url = closed_port_url()
    command = [sys.executable, str(FAKE_HOST), "--save", save, "--first-warning", "10", "--plan", "alarm,ok"]
    out = supervise(["--webhook", url], command)
    assert out.returncode == 0, out.output
    lines = [line for line in out.output.splitlines() if "webhook" in line and "not delivered" in line]
    assert len(lines) == 2, out.output[-3000:]
    assert f"not delivered to {_host(url)} after 3 attempts: connection refused" in lines[0]
    assert f"2 webhook messages not delivered to {_host(url)} (first: connection refused)" in lines[1]
