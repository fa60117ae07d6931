"""The in-sandbox tool server.

This package runs *inside* the sandbox with nothing but the image's ``python3`` (>= 3.8)
and the pure-Python ``ptyprocess`` (bind-mounted read-only next to it). It must therefore
import only the standard library, ptyprocess and its own modules (relative imports), so
it works whether it is imported as ``rolloutd.sandbox.toolserver`` on the host or as
``rolloutd_toolserver`` inside the sandbox.
"""

PROTOCOL_VERSION = 1
