"""The message bus: the only package that imports zmq and msgpack.

Endpoints, the socket helper, the codec, typed message definitions with the protocol
version, and the events stream.
"""
from rolloutd.bus.messages import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
