"""Webhook posts against a local HTTP server on 127.0.0.1: delivered, and never blocking when
the server is down or slow (the session's poster and the supervisor's)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.webhook import WebhookPoster, WebhookSettings, send
from tests.supervise._helpers import FAKE_HOST, Hook, closed_port_url, records, supervise


def test_send_and_poster_deliver_slack_json():
    with Hook() as hook:
        assert send(hook.url, {"text": "hello", "mechmon": {"event": "alarm"}})
        poster = WebhookPoster(hook.url)
        poster.post({"text": "second"})
        poster.close(wait_s=5.0)
    assert [b["text"] for b in hook.bodies] == ["hello", "second"] and poster.sent == 1


def test_poster_never_blocks_on_a_down_or_slow_server():
    fast = WebhookSettings(timeout_s=0.5, retries=1, backoff_s=0.1)
    down = WebhookPoster(closed_port_url(), fast)
    start = time.monotonic()
    down.post({"text": "lost"})
    assert time.monotonic() - start < 0.2  # post() only queues
    down.close(wait_s=3.0)
    assert down.dropped == 1 and down.sent == 0
    with Hook(delay_s=5.0) as hook:
        slow = WebhookPoster(hook.url, fast)
        start = time.monotonic()
        for k in range(3):
            slow.post({"text": f"m{k}"})
        slow.close(wait_s=0.5)  # bounded: gives up waiting, the daemon thread is left behind
        assert time.monotonic() - start < 1.5
    assert not send(closed_port_url(), {"text": float("inf")})  # invalid JSON is refused, not raised


def test_session_flag_is_validated():
    with pytest.raises(ValueError, match="^alert_webhook must be an http"):  # the field; front ends spell it
        MechmonConfig(enabled=True, alert_webhook="slack.example/hook")
    assert MechmonConfig(enabled=True, alert_webhook="https://hooks.example/x").alert_webhook


def test_supervisor_posts_each_action(tmp_path: Path):
    save = tmp_path / "ck"
    command = [sys.executable, str(FAKE_HOST), "--save", save, "--first-warning", "10", "--plan", "alarm,ok"]
    with Hook() as hook:
        out = supervise(["--webhook", hook.url], command)
    assert out.returncode == 0, out.output
    assert [b["mechmon"]["action"] for b in hook.bodies] == ["relaunch", "stop"]
    first = hook.bodies[0]
    assert first["text"].startswith("[mechmon-supervise] RELAUNCH") and first["mechmon"]["event"] == "recovery"
    assert first["mechmon"]["checkpoint"]["name"] == "iter_0000010"


def test_supervisor_goes_on_when_the_webhook_is_down(tmp_path: Path):
    save = tmp_path / "ck"
    command = [sys.executable, str(FAKE_HOST), "--save", save, "--first-warning", "10", "--plan", "alarm,ok"]
    out = supervise(["--webhook", closed_port_url()], command)
    assert out.returncode == 0 and [r["action"] for r in records(save)] == ["relaunch", "stop"], out.output
    assert out.seconds < 30, out.seconds


@pytest.mark.parametrize("server", ["up", "down"])
def test_the_session_posts_its_alarm_and_never_waits_long(tmp_path: Path, server: str):
    from tests.session.test_session import ToyAttention, make_session, run

    layers = [ToyAttention(1, 0)]
    with Hook() as hook:
        url = hook.url if server == "up" else closed_port_url()
        session = make_session(tmp_path, layers, drill_at=7, action="checkpoint-and-abort", alert_webhook=url)
        start = time.monotonic()
        decisions = run(session, layers, 7)
        session.close()  # bounded wait for the queue (2 s)
        assert decisions[-1].abort and time.monotonic() - start < 15
    if server == "up":
        (body,) = hook.bodies
        assert body["text"].startswith("[mechmon] ALARM at iteration 7") and body["mechmon"]["family"] == "drill"
        assert body["mechmon"]["event"] == "alarm" and body["mechmon"]["action"] == "checkpoint-and-abort"
