"""packer clean on a URL: a publisher killed with kill -9 mid-upload leaves its lease, a multipart
upload and half a version folder; clean refuses while the lease is fresh, then takes it over, aborts
the upload and deletes the folder, and leaves every published version whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from click.testing import CliRunner

from packer.cli import main
from packer.store import open_store
from packer.store.published import LEASE, version_key
from packer.tools.clean import clean_url
from packer.tools.verify import verify

from .conftest import Versions

HALF = "d" * 32  # the killed publish's version

#: A publisher that takes the lease, begins a multipart upload and half a version, then hangs.
PUBLISHER = f"""
import sys, time
from packer.store import open_store
from packer.store.published import Lease, version_key
store = open_store(sys.argv[1])
with Lease(store, ttl_s=2.0, quiet=True):
    key = version_key("{HALF}", "shard-00000.bin")
    upload = store._create_upload(key, {{}})
    store._upload_part(key, upload, 1, b"x" * (5 << 20))
    store.put(version_key("{HALF}", "index.npy"), b"half an index")
    print("ready", flush=True)
    time.sleep(600)
"""


def test_clean_after_a_killed_publish(versions: Versions) -> None:
    store = open_store(versions.url)
    child = subprocess.Popen([sys.executable, "-c", PUBLISHER, versions.url], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    gone = clean_url(versions.url, quiet=True)  # its holder's process is gone: the lease is taken over at once
    key = version_key(HALF, "shard-00000.bin")
    assert gone == [f"the unfinished upload of {store.name(key)} (begun " + gone[0].split("(begun ")[1]] + [
        store.name(version_key(HALF, "index.npy"))
    ]
    assert store.uploads() == [] and LEASE not in {o.key for o in store.list()}
    for version in versions.ids:
        assert verify(versions.url, version=version).ok
    again = CliRunner().invoke(main, ["clean", versions.url])
    assert (
        again.exit_code == 0
        and f"packer: {versions.url}: nothing left by interrupted publishes deleted" in again.output
    )
