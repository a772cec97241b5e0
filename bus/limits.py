"""What the bus admits: frame sizes, queue lengths and the subscription grammar.

These are the broker's promises about memory, so they live in one place: the
broker enforces them on every socket it binds, publishers keep their messages
within them, and the state service sizes its replies by them.

* A message is ``[topic, payload]`` with a payload of at most `MAX_FRAME_BYTES`.
  Sockets admit frames up to such a limit plus the handshake's overhead (see
  `socket_limit`): libzmq disconnects a peer that sends a longer frame before
  any of it is queued, and the broker drops a payload between the two.
* A subscription is a one-frame message ``\\x01 PREFIX`` (``\\x00`` cancels it)
  whose ``PREFIX`` is an evtrain topic or a prefix of one (the empty prefix
  means everything), so at most `MAX_SUBSCRIPTION_BYTES` long. libzmq keeps
  every distinct subscription a subscriber sent until it leaves, in a trie
  many times its size, and no option bounds how many: the frame limit keeps
  each one short. Each subscriber that leaves then costs a walk over the
  whole trie, long once many distinct subscriptions are held, so a bus open
  to users who are not trusted needs CURVE (figures: docs/benchmarks.md,
  "Measurements behind design choices").
* libzmq bounds its queues in messages, not bytes: the broker queues at most
  `QUEUE_MESSAGES` messages of at most `MAX_MESSAGE_BYTES` towards each
  subscriber, `PEER_BYTES` (160 MiB) for one that stops reading while the
  largest messages flow, plus what the kernel buffers for the connection;
  routine events are ~250 bytes, so a lagging hook costs a few MiB. From each
  publisher it queues `INPUT_QUEUE_MESSAGES` as well, which fill only while
  the proxy falls behind.
"""

from __future__ import annotations

from evtrain.events import BY_TAG

TOPICS: frozenset[bytes] = frozenset(tag.encode() for tag in BY_TAG)
"""Every topic a valid message can have."""

SUBSCRIPTION_PREFIXES: frozenset[bytes] = frozenset(
    topic[:end] for topic in TOPICS for end in range(len(topic) + 1)
)
"""The prefixes a subscription may name: every prefix of every topic, ``b""`` included."""

MAX_FRAME_BYTES = 16 * 1024
"""Largest frame of an event or a command (the payload; topics are far shorter).

The largest legitimate messages are failures with their tracebacks; a publisher
shortens the text of a longer message to fit (see `Publisher`).
"""

MAX_TOPIC_BYTES = max(len(topic) for topic in TOPICS)
MAX_MESSAGE_BYTES = MAX_TOPIC_BYTES + MAX_FRAME_BYTES
"""Largest ``[topic, payload]`` message the broker forwards."""

MAX_SUBSCRIPTION_BYTES = 1 + MAX_TOPIC_BYTES
"""Largest frame a subscriber may send: a (un)subscribe byte and a topic prefix."""

QUEUE_MESSAGES = 10_000
"""Messages the broker queues per subscriber (its default high-water mark).

Deep enough for bursts: a hook that is busy, or whose I/O thread gets no CPU for
a moment, catches up from it. (libzmq's queues have hysteresis: a full queue
takes messages again once half of it drained, so a mark cannot be changed
per message without cutting a subscriber off for good.)
"""

INPUT_QUEUE_MESSAGES = 10_000
"""Messages the broker queues from each publisher, and upstream from each subscriber.

As deep as a publisher's own queue: a stage that publishes a burst and exits
(its last events, ``run.ended``) must find room at once, because what is still
queued in a process when it exits is lost with it (pyzmq does not wait for a
socket's linger at interpreter exit); a 1000-message queue lost such tails.
"""

PEER_BYTES = QUEUE_MESSAGES * MAX_MESSAGE_BYTES
"""Most bytes the broker queues for one subscriber with the default high-water mark."""

WIRE_OVERHEAD_BYTES = 1024
"""What ZMTP adds to the frames a socket limit applies to, with CURVE.

libzmq checks ``ZMQ_MAXMSGSIZE`` on every frame it decodes, handshake commands
included (a CURVE INITIATE with its metadata is several hundred bytes) and, with
CURVE, on the encrypted frame (33 bytes longer than the message).
"""

NULL_WIRE_OVERHEAD_BYTES = 32
"""The same without CURVE: a subscriber's handshake is a READY of 28 bytes.

The sockets facing publishers admit far longer frames anyway, and the state
endpoint's clients (whose READY carries their identity) always get the larger
overhead.
"""

MAX_REQUEST_BYTES = 256
"""Largest frame a state-service client may send (a request is ``snapshot``)."""

STATE_REPLIES_QUEUED = 2
"""Snapshot replies the state service queues per client that is not reading them."""


def socket_limit(max_frame: int, *, curve: bool = True) -> int:
    """The ``ZMQ_MAXMSGSIZE`` that admits frames of ``max_frame`` bytes and the handshake."""
    return max_frame + (WIRE_OVERHEAD_BYTES if curve else NULL_WIRE_OVERHEAD_BYTES)


def valid_subscription(frame: bytes) -> bool:
    """Whether ``frame`` is a well-formed (un)subscription to evtrain topics."""
    return frame[:1] in (b"\x00", b"\x01") and frame[1:] in SUBSCRIPTION_PREFIXES
