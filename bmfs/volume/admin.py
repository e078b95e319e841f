"""Volume administration as requests: one table for the control file of a mount and
for the commands that open a volume themselves (`bmfs repair --offline`...)."""
from __future__ import annotations

from . import devices, repair

# request -> the function that runs it on a volume (its fields are its keyword arguments)
DEVICE_OPS = {
    "repair": repair.repair,
    "scrub": repair.scrub,
    "rebalance": repair.rebalance,
    "drain": devices.drain,
    "undrain": devices.undrain,
    "add_device": devices.add_device,
    "set_address": devices.set_address,
}
