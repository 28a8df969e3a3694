"""A webhook URL is parsed whole at start-up (``session/webhook.py::check_webhook_url``).

Every front end checks it when it parses: ``--mechmon-alert-webhook`` (trainer, Megatron-LM),
``ds_config.mechmon.alert_webhook`` (DeepSpeed, tests/deepspeed/test_ds_attach_input.py) and
``mechmon-supervise --webhook``. A URL that passes is one the poster accepts later, so no
``ValueError`` can surface after the model is built.
"""

from __future__ import annotations

import argparse

import pytest

from mechmon_megatron.cli.args import add_mechmon_args, validate_mechmon_args
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.webhook import WebhookPoster, check_webhook_url

BAD = ["http://", "http://:80/x", "https://host:99999/", "ftp://x", "https://host:port/", "http://ho st/x",
       "https://hooks.example/a b", "http:///path", "hooks.example/x", "http://host\n/x",
       "https://hooks.example/é", "http://host:0/x"]
GOOD = ["http://127.0.0.1:8080/hook", "https://hooks.slack.com/services/T0/B0/x", "http://[::1]:9000/",
        "HTTPS://Hooks.Example", "http://h"]


@pytest.mark.parametrize("url", BAD)
def test_bad_url_is_refused(url):
    with pytest.raises(ValueError, match=r"must be an http:// or https:// URL"):
        check_webhook_url(url)
    with pytest.raises(ValueError, match=r"^alert_webhook must be an http:// or https:// URL"):
        MechmonConfig(enabled=True, alert_webhook=url)  # the field; each front end spells it (test_bad_settings.py)


@pytest.mark.parametrize("url", GOOD)
def test_a_url_that_passes_is_accepted_by_the_poster(url):
    assert check_webhook_url(url) == url
    assert MechmonConfig(enabled=True, alert_webhook=url).alert_webhook == url
    WebhookPoster(url)  # the session builds this on the writer rank: it must not raise there


@pytest.mark.parametrize("url", ["http://", "http://:80/x", "https://host:99999/", "ftp://x"])
def test_flag_is_refused_at_parse_time_naming_it(url, capsys):
    parser = add_mechmon_args(argparse.ArgumentParser(prog="trainer"))
    args = parser.parse_args(["--mechmon", "--mechmon-alert-webhook", url])
    with pytest.raises(SystemExit) as exc:
        validate_mechmon_args(parser, args)
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("trainer: error: --mechmon-alert-webhook must be"), errors


@pytest.mark.parametrize("url", ["http://", "http://:80/x", "https://host:99999/", "ftp://x"])
def test_supervisor_webhook_is_refused_at_parse_time_naming_it(url, capsys):
    from mechmon_megatron.supervise.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--webhook", url, "--", sys_executable(), "-c", "pass"])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "error: --webhook must be an http:// or https:// URL" in errors[0], errors


def sys_executable() -> str:
    import sys

    return sys.executable
