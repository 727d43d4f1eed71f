"""``packer compact``: rewrite a dataset into one segment, without the dead bytes refreshes left
(packer.builder.segments), under the build's lock and through its staging folder and rename."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil

import numpy as np

from ..backends import BACKENDS, data_files
from ..backends.pin import pin
from ..backends.walk import InOrder
from ..builder.options import SHARD_SIZE
from ..builder.paths import build_lock, dataset_path
from ..builder.segments import data_table
from ..builder.staging import (
    BUILD_STATE,
    INDEX_PART,
    PROGRESS,
    SOURCES_PART,
    finalize,
    staging_path,
    write_json_atomic,
)
from ..errors import BuildError, say
from ..format import (
    LABELS,
    REPORT,
    TARGETS,
    Manifest,
    index_digest,
    logical_digest,
    open_regular,
    source_path,
    written_version,
)


def compact(out: str | os.PathLike, quiet: bool = False) -> tuple[Manifest, Manifest]:
    """Rewrite the dataset at ``out`` into one segment (no dead bytes), every record copied as it is
    and checked against its CRC-32 on the way; (old manifest, new manifest). Same records, labels and
    ``digest`` (a version-1 or 2 dataset becomes version 3, whose digest is defined otherwise)."""
    out = dataset_path(out)
    with build_lock(out):
        pinned = pin(str(out.resolve()))
        old, index = pinned.manifest, pinned.index
        staging = staging_path(out)
        if staging.exists():
            if (staging / PROGRESS).is_file():
                say(f"{out}: deleting the interrupted build in {staging} (a --resume of it would start over)", quiet)
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        write_json_atomic(staging / BUILD_STATE, {"compact": out.name})  # packer's: `packer clean` deletes it
        backend = BACKENDS[old.backend]
        for name in data_files(old):  # LMDB: liblmdb must not walk a damaged file
            backend.check_walkable(out / name)
        writer = backend.open_writer(staging, None, int(old.options.get("shard_size", SHARD_SIZE)))
        rows = np.array(index)
        records = InOrder(out, old, index)
        try:
            for j in range(len(index)):
                data = records.intact(j)
                if data is None:
                    raise BuildError(
                        f"{out}: record {j} ({source_path(pinned.sources, index[j])}) is missing or damaged; "
                        f"compact copies records as they are (rebuild with build --force)"
                    )
                rows[j]["shard"], rows[j]["offset"] = writer.append(data)
        except BaseException:
            writer.close()
            shutil.rmtree(staging)
            raise
        finally:
            records.close()
        shards = writer.close()
        rows.tofile(staging / INDEX_PART)
        np.asarray(pinned.sources).tofile(staging / SOURCES_PART)
        with (
            contextlib.suppress(FileNotFoundError),  # the dataset's own report, never what a symlink leads to
            open(open_regular(out / REPORT), "rb") as src,
            open(staging / REPORT, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst)
        arrays = {
            name: np.asarray(a) for name, a in ((LABELS, pinned.multi), (TARGETS, pinned.targets)) if a is not None
        }
        table, total, dead, segments = data_table(staging, rows, None, shards)
        new = dataclasses.replace(
            old,
            format_version=written_version(old.fields),
            shards=table,
            bytes=total,
            dead_bytes=dead,
            segments=segments,
            digest=logical_digest(rows, old.labels_digest),
            index_digest=index_digest(rows),
            sources_digest=index_digest(pinned.sources),
        )
        del pinned, index, records
        finalize(staging, out, new, arrays)
    say(f"{out}: compacted {old.bytes / 1e6:.1f} MB in {old.segments} segment(s) into {total / 1e6:.1f} MB", quiet)
    return old, new
