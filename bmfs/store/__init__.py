"""Fragment stores: where a device keeps fragments. Blocking calls, run in threads.

Interface (duck-typed; see file.py): ``write(name, parts)``, ``read(name, offset,
length)``, ``delete(name)``, ``sync()``, ``names()``, ``usage()``, ``check()``.
"""
