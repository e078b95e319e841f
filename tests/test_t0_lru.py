"""Level 0: the bounded least-recently-used dict behind the caches (bmfs/lru.py)."""
import copy
import pickle

from bmfs.lru import LRU


def test_lru_drops_the_least_recently_used():
    c = LRU(3)
    for k in "abc":
        c.put(k, k.upper())
    assert c.hit("a") == "A"          # a is now the most recent
    assert c.get("b") == "B"          # get does not reorder
    c.put("d", "D")                   # over the limit: b, the oldest, goes
    assert list(c) == ["c", "a", "d"]
    c.put("c", "C2")                  # replacing counts as a use
    c.put("e", "E")
    assert list(c) == ["d", "c", "e"] and c["c"] == "C2"
    assert c.hit("zz", 0) == 0 and "zz" not in c
    c.put("n", None)                  # a stored None is told apart from a miss
    assert c.hit("n", "miss") is None and list(c)[-1] == "n"
    for twin in (c.copy(), copy.copy(c), pickle.loads(pickle.dumps(c))):
        assert type(twin) is LRU and twin.limit == 3 and list(twin.items()) == list(c.items())
        twin.put("x", 1)
        assert len(twin) == 3 and "x" not in c
