"""Volume administration as requests: one table for the control file of a mount and
for the commands that open a volume themselves (`bmfs repair --offline`...).

``install(fs)`` makes the control file of ``fs`` (vfs/control.py) serve status,
device records and the device operations through the handlers here: the vfs names
the requests and checks who may send them, this layer runs them.
"""
from __future__ import annotations

from . import devices, repair, status
from .volume import device_records

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


def install(fs) -> None:
    """Serve the volume administration of ``fs.volume`` through ``fs``'s control file."""
    volume, control = fs.volume, fs.control

    async def volume_status() -> dict:
        root = fs.views.by_id.get(0)  # (the tree at the mount's root: its branch)
        return await status.volume_status(volume, branch=root and root.name)

    async def records() -> dict:  # every device record, removed ones too
        return {str(dev): rec for dev, rec in (await device_records(volume.kv)).items()}

    control.serve("status", volume_status)
    control.serve("devices", records)
    for op, fn in DEVICE_OPS.items():
        control.serve(op, lambda fn=fn, **args: fn(volume, **args))
