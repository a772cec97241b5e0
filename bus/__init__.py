"""The ZeroMQ bus: broker, publisher, subscriber, addresses, stage-side commands, CURVE."""

from evtrain.bus.address import BusAddress, free_port_block
from evtrain.bus.broker import Broker
from evtrain.bus.commands import CommandLedger, CommandReceiver
from evtrain.bus.publisher import Publisher, flush_process
from evtrain.bus.security import (
    CurveConfig,
    CurveServer,
    curve_from_env,
    ensure_curve_dir,
    load_client,
    load_server,
)
from evtrain.bus.sequence import SequenceTracker
from evtrain.bus.state_service import fetch_snapshot, ping_broker
from evtrain.bus.subscriber import Subscriber

__all__ = [
    "Broker",
    "BusAddress",
    "CommandLedger",
    "CommandReceiver",
    "CurveConfig",
    "CurveServer",
    "Publisher",
    "SequenceTracker",
    "Subscriber",
    "curve_from_env",
    "ensure_curve_dir",
    "fetch_snapshot",
    "flush_process",
    "free_port_block",
    "load_client",
    "load_server",
    "ping_broker",
]
