"""Bad input to ``attach`` is refused at once, naming the key, before the engine is touched.

The engine here is a bare ``object()``: every refusal below happens before the adapter reads
anything from it (any access would raise AttributeError instead of the ValueError checked).
"""

from __future__ import annotations

import logging

import pytest

from mechmon_megatron.adapters.deepspeed import attach
from mechmon_megatron.session.config import MechmonConfig

ABORT = {"enabled": True, "monitors": ["router"], "action": "checkpoint-and-abort"}


@pytest.mark.parametrize(
    "fn,message",
    [
        (lambda: {"mechmon": {}, "sampler": 3},
         r"client_state_fn=\.\.\.\) returns key\(s\) \['mechmon'\], which mechmon"),
        (lambda: {"mechmon_alert": 1}, r"returns key\(s\) \['mechmon_alert'\]"),
        (lambda: [("sampler", 3)], r"client_state_fn=\.\.\.\) must return a dict .*got list"),
        (lambda: 1 / 0, r"client_state_fn=\.\.\.\) raised ZeroDivisionError"),
        ({"sampler": 3}, r"client_state_fn=\.\.\.\) must be a callable .* got dict"),
    ],
)
def test_user_client_state_that_cannot_be_merged_is_refused(tmp_path, fn, message):
    section = {**ABORT, "checkpoint_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=message):
        attach(object(), section, client_state_fn=fn)


def test_abort_directory_is_checked_at_attach(tmp_path):
    no_dir = MechmonConfig(enabled=True, monitors=("router",), action="checkpoint-and-abort")
    with pytest.raises(ValueError, match=r"ds_config\.mechmon\.action checkpoint-and-abort .*ds_config\.mechmon\."
                                         r"checkpoint_dir .*is not set"):
        attach(object(), no_dir)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"needs a checkpoint folder it can write, .*exists and is not a directory"):
        attach(object(), no_dir, checkpoint_dir=str(blocker))
    with pytest.raises(ValueError, match=r"exists and is not a directory"):  # the section's key, checked as well
        attach(object(), {**ABORT, "checkpoint_dir": str(blocker)})


def test_disabled_config_accepts_anything():
    disabled = attach(object(), MechmonConfig(enabled=False), client_state_fn=lambda: {"mechmon": 1})
    assert disabled.session.enabled is False


def test_save_with_mechmons_key_is_refused_before_anything_is_written(tmp_path):
    """engine.save_checkpoint(client_state={"mechmon": ...}): the user's value would be replaced."""
    wrapper = attach(object(), MechmonConfig(enabled=False))
    saved: list = []
    with pytest.raises(ValueError, match=r"key\(s\) \['mechmon'\] are mechmon's"):
        wrapper._save_checkpoint(lambda *a, **k: saved.append(a), str(tmp_path), "t", {"mechmon": 1, "step": 3})
    assert saved == [] and not any(tmp_path.iterdir())


@pytest.mark.parametrize("url", ["http://", "http://:80/x", "https://host:99999/", "ftp://x"])
def test_bad_webhook_is_refused_at_attach_naming_the_key(url):
    """Parsed whole when the section is read, before the engine is touched (never a ValueError from
    the session's poster after the model is built)."""
    with pytest.raises(ValueError, match=r"^ds_config\.mechmon\.alert_webhook must be an http:// or https:// URL"):
        attach(object(), {"enabled": True, "monitors": ["router"], "alert_webhook": url})


def test_section_without_enabled_is_refused_at_attach():
    with pytest.raises(ValueError, match=r"^ds_config\.mechmon\.enabled is not set, but the section sets "
                                         r"\['interval'\]"):
        attach(object(), {"train_batch_size": 4, "mechmon": {"interval": 10}})
    with pytest.raises(ValueError, match=r"^ds_config\.mechmon\.enabled is not set"):
        attach(object(), {"interval": 10})  # a section dict


def test_explicit_disabled_section_says_so_once(caplog):
    caplog.set_level(logging.INFO, logger="mechmon_megatron")
    off = attach(object(), {"train_batch_size": 4, "mechmon": {"enabled": False, "interval": 10}})
    assert off.session.enabled is False
    lines = [r.getMessage() for r in caplog.records if "not monitoring" in r.getMessage()]
    assert lines == ["[mechmon] ds_config.mechmon is present with enabled: false: not monitoring"]
    caplog.clear()
    attach(object(), MechmonConfig(enabled=False))  # a config object: no section, nothing to say
    assert not [r for r in caplog.records if "not monitoring" in r.getMessage()]
