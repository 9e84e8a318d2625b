"""Collecting checkpoints nothing needs any more: a mark-and-sweep over the checkpoint store.

Workers delete a request's state once its outcome is committed; a worker killed between the commit
and the delete, or cut off from the store, leaves it behind. So:

1. mark: read every state; a state whose request has an outcome, or whose job is closed, is deleted
   (one unreadable and older than ``min_age`` too); every other state marks the blocks it names;
2. sweep: delete each KV block no state marked, unless it is younger than ``min_age``: a worker
   writes a request's blocks before the state naming them, so a block just written may not be named
   yet;
3. on a store that keeps temporary files (the local folder: ``sweep_temporaries``), delete those
   older than ``min_age``, left by writers killed half-way (of checkpoints and job files alike).

A block written long ago, forgotten by every state and named again by a new one while the sweep
runs can be deleted under it; the request then recomputes from that block on when it resumes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy import or_, select

from jobs.db import Database
from jobs.lifecycle import LIVE
from jobs.models import Job, RequestRow, Result
from storage import ObjectNotFound, ObjectStore
from worker.checkpoint.format import KV_PREFIX, STATE_PREFIX, CorruptCheckpoint, RequestCheckpoint, block_key

log = logging.getLogger("berth.checkpoint")

QUERY_CHUNK = 1000  # request ids per database query


@dataclass(frozen=True)
class Collected:
    states_deleted: int
    blocks_deleted: int
    blocks_kept: int
    temporaries_deleted: int = 0


def collect_checkpoints(store: ObjectStore, db: Database, min_age: float) -> Collected:
    now = time.time()
    states: dict[str, RequestCheckpoint] = {}  # key -> state
    dead_states = []
    for info in store.list(STATE_PREFIX):
        try:
            states[info.key] = RequestCheckpoint.from_json(store.get(info.key))
        except ObjectNotFound:  # deleted since the listing
            continue
        except CorruptCheckpoint:
            if now - info.modified >= min_age:
                dead_states.append(info.key)
    over = _closed_requests(db, [s.request_id for s in states.values()])
    dead_states += [key for key, state in states.items() if state.request_id in over]
    for key in dead_states:
        store.delete(key)
    marked = {block_key(s.fingerprint, h) for key, s in states.items() if s.request_id not in over
              for h in s.block_hashes()}
    deleted = kept = 0
    for info in store.list(KV_PREFIX):
        if info.key in marked or now - info.modified < min_age:
            kept += 1
        else:
            store.delete(info.key)
            deleted += 1
    sweep = getattr(store, "sweep_temporaries", None)  # the local store's; S3 lists no half-written objects
    temporaries = sweep(min_age) if sweep is not None else 0
    collected = Collected(len(dead_states), deleted, kept, temporaries)
    log.info("checkpoint collection: %s", collected)
    return collected


def _closed_requests(db: Database, request_ids: list[str]) -> set[str]:
    """The ids among ``request_ids`` of requests with an outcome or in a closed job."""
    ids = [int(r) for r in request_ids if r.isdigit()]  # other ids are not the jobs database's
    closed = set()
    with db.session() as s:
        for i in range(0, len(ids), QUERY_CHUNK):
            closed.update(str(r) for r in s.scalars(
                select(RequestRow.id).join(Job, Job.id == RequestRow.job_id)
                .outerjoin(Result, Result.request_id == RequestRow.id)
                .where(RequestRow.id.in_(ids[i:i + QUERY_CHUNK]),
                       or_(Result.id.is_not(None), Job.status.not_in(LIVE)))))
    return closed
