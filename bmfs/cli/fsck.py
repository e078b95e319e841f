"""bmfs fsck VOLUME [--full] [--repair]: exit 0 only when the volume is consistent, 1
when it found problems (damaged metadata records among them), 2 when the volume
cannot be read at all (no volume, a metadata database SQLite cannot open)."""
from .common import run_trio


def add_parser(sub):
    p = sub.add_parser("fsck", help="check a volume (unmounted)")
    p.add_argument("volume", help="the volume directory (not mounted)")
    p.add_argument("--full", action="store_true", help="verify every block checksum")
    p.add_argument("--repair", action="store_true",
                   help="delete leaked fragment files and collect queued garbage")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..errors import MetaDamaged
    from ..volume.fsck import fsck, fsck_records
    from ..volume.volume import Volume
    from .progress import Bar

    async def main():
        try:
            vol = await Volume.open(args.volume, upgrade=args.repair)
        except MetaDamaged as e:  # a record needed to open it (devices, ...): say which
            problems, notes = await fsck_records(args.volume, args.full)
            return problems or [str(e)], notes
        try:
            with Bar("fsck") as bar:
                return await fsck(vol, full=args.full, repair=args.repair, progress=bar)
        finally:
            await vol.aclose()
    problems, notes = run_trio(main)
    for n in notes:
        print(f"note: {n}")
    for p in problems:
        print(f"problem: {p}")
    print(f"{args.volume}: " + ("consistent" if not problems else f"{len(problems)} problems"))
    return 1 if problems else 0
