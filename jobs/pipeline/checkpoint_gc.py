"""Collecting checkpoints nothing needs any more: a mark-and-sweep over the checkpoint store. Mark the
segments open requests' rows point into and the KV runs their states name; delete the rest once
older than ``min_age``, with the pre-segment ``checkpoints/v1/`` objects and stale temporary files
(docs/checkpoints.md).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import select

from jobs.records.db import Database
from jobs.records.lifecycle import LIVE
from jobs.records.models import Job, RequestRow, Result
from storage import ObjectNotFound, ObjectStore
from worker.checkpoint.format import (
    KV_PREFIX,
    LEGACY_PREFIX,
    SEGMENT_PREFIX,
    CorruptCheckpoint,
    RequestCheckpoint,
    StateRef,
    kv_key,
)

log = logging.getLogger("berth.checkpoint")


@dataclass(frozen=True)
class Collected:
    segments_deleted: int
    segments_kept: int
    runs_deleted: int
    runs_kept: int
    legacy_deleted: int = 0
    temporaries_deleted: int = 0


def collect_checkpoints(store: ObjectStore, db: Database, min_age: float) -> Collected:
    now = time.time()
    live = _live_refs(db)
    segments = defaultdict(list)  # live segment key -> the ranges of its states that are some request's latest
    for ref in live:
        segments[ref.key].append(ref)
    seg_deleted = seg_kept = 0
    for info in store.list(SEGMENT_PREFIX):
        if info.key in segments or now - info.modified < min_age:
            seg_kept += 1
        else:
            store.delete(info.key)
            seg_deleted += 1
    kv = list(store.list(KV_PREFIX))
    marked = _marked_runs(store, segments) if kv else set()
    runs_deleted = runs_kept = 0
    for info in kv:
        if info.key in marked or now - info.modified < min_age:
            runs_kept += 1
        else:
            store.delete(info.key)
            runs_deleted += 1
    legacy = 0
    for info in store.list(LEGACY_PREFIX):
        if now - info.modified >= min_age:
            store.delete(info.key)
            legacy += 1
    sweep = getattr(store, "sweep_temporaries", None)  # the local store's; S3 lists no half-written objects
    temporaries = sweep(min_age) if sweep is not None else 0
    collected = Collected(seg_deleted, seg_kept, runs_deleted, runs_kept, legacy, temporaries)
    log.info("checkpoint collection: %s", collected)
    return collected


def _live_refs(db: Database) -> list[StateRef]:
    """The refs of requests with no outcome in live jobs (a ref that is not one berth writes is skipped)."""
    refs = []
    with db.session() as s:
        rows = s.execute(select(RequestRow.id, RequestRow.checkpoint).join(Job, Job.id == RequestRow.job_id)
                         .outerjoin(Result, Result.request_id == RequestRow.id)
                         .where(RequestRow.checkpoint.is_not(None), Result.id.is_(None), Job.status.in_(LIVE)))
        for request_id, text in rows:
            try:
                refs.append(StateRef.parse(text))
            except CorruptCheckpoint:
                log.warning("request %s: its checkpoint reference %r is not one berth writes; ignored", request_id,
                            text[:100])
    return refs


def _marked_runs(store: ObjectStore, segments: dict[str, list[StateRef]]) -> set[str]:
    """The keys of the KV runs named by the live states, each live segment read once."""
    marked = set()
    for key, refs in segments.items():
        try:
            raw = store.get(key)
        except ObjectNotFound:
            continue
        for ref in refs:
            try:
                state = RequestCheckpoint.from_json(raw[ref.offset:ref.offset + ref.length])
            except CorruptCheckpoint:
                continue
            marked.update(kv_key(state.fingerprint, last) for last in state.kv_runs)
    return marked
