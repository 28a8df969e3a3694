"""Bad input to ``attach`` is refused at once, naming the key, before the engine is touched.

The engine here is a bare ``object()``: every refusal below happens before the adapter reads
anything from it (any access would raise AttributeError instead of the ValueError checked).
"""

from __future__ import annotations

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
