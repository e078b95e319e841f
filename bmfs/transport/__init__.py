"""Transports carry fragment operations from a client to the devices that store them.

Interface (all async): ``put(dev, name, parts)``, ``read(dev, name, ranges) -> list
of bytes``, ``delete(dev, name)``, ``sync(dev)``, ``aclose()``. A transport raises
``DeviceError`` when a device cannot serve a request (missing, down, I/O error); the
data client treats that like a lost fragment.
"""


class DeviceError(Exception):
    """A device could not serve a request; ``dev`` names it."""

    def __init__(self, dev: int, message: str):
        super().__init__(f"device {dev}: {message}")
        self.dev = dev
