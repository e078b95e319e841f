"""A real 3-member etcd cluster for tests (bmfs/cluster/etcd.py starts the members).

``EtcdCluster()`` starts the members in a temporary directory, secure as `bmfs cluster
up` runs them (TLS client certificates and a root password: ``creds``), waits until
every one is healthy and offers ``url`` (for ``EtcdKV.create`` and mkfs; it names the
credentials' files), ``url_of(indices)``, ``post(i, path, body)`` (an authenticated
gateway request), ``pids``, ``leader_index()``, ``kill(i)`` (SIGKILL by pid),
``restart(i)``, ``wipe()`` and ``stop()`` (kills the members it started by pid and
removes the directory). The
``etcd_cluster`` fixture gives one cluster per test module and skips when the etcd
binary is missing (``tools/setup.sh --test`` installs it).
"""
from __future__ import annotations

import os

import pytest

from bmfs.cluster.etcd import ETCD, EtcdCluster, free_ports  # noqa: F401  (re-exported)


@pytest.fixture(scope="module")
def etcd_cluster():
    if not os.access(ETCD, os.X_OK):
        pytest.skip(f"etcd not installed ({ETCD}); tools/setup.sh --test installs etcd-server")
    cluster = EtcdCluster()
    try:
        yield cluster
    finally:
        cluster.stop()
