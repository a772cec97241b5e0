"""The ZeroMQ bus: broker, publisher, subscriber, addresses, stage-side commands."""

from evtrain.bus.address import BusAddress, free_port_block
from evtrain.bus.broker import Broker
from evtrain.bus.commands import CommandReceiver
from evtrain.bus.publisher import Publisher
from evtrain.bus.sequence import SequenceTracker
from evtrain.bus.state_service import fetch_snapshot
from evtrain.bus.subscriber import Subscriber

__all__ = [
    "Broker",
    "BusAddress",
    "CommandReceiver",
    "Publisher",
    "SequenceTracker",
    "Subscriber",
    "fetch_snapshot",
    "free_port_block",
]
