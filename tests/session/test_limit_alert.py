"""The alert of an absolute-limit alarm (the routing-entropy floor): where a rollback must reach."""

from mechmon_megatron.detect.pooled_cusum import PooledAlarm
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.detector_setup import alert_of, load_detector_design


def _limit_alarm(change_step):
    return PooledAlarm(step=200, family="router_entropy", level="layer", kind="limit", layers=(1,),
                       members=("token_entropy",), statistic=0.52, threshold=0.693, change_step=change_step,
                       reason="stable-winner collapse")


def test_limit_alert_reaches_back_to_the_first_checks_window():
    """The limit judges a stream that never had a baseline: the drift may have begun anywhere since
    the stream's first check without a baseline (100 here), whose window starts at 100 - delta."""
    config = MechmonConfig(enabled=True, interval=20, delta=100)
    design, _ = load_detector_design(config)
    alert = alert_of(_limit_alarm(100), config, design)
    assert alert.kind == "limit" and alert.stream == "router_entropy/layer_1"
    assert alert.first_warning_step == 0
    resumed = alert_of(_limit_alarm(5100), config, design)  # monitors first checked at 5,100
    assert resumed.first_warning_step == 5000


def test_limit_alert_of_an_older_state_keeps_the_patience_rule():
    config = MechmonConfig(enabled=True, interval=20, delta=100)
    design, _ = load_detector_design(config)
    alert = alert_of(_limit_alarm(None), config, design)
    assert alert.first_warning_step == 200 - (design.limit_patience - 1) * 20
