"""Engine workers as the jobs database knows them: each one's last heartbeat and an hour of them (the
dashboard's workers), and the worker deaths found while claiming requests, recorded once each with how
many requests the dead worker was running (docs/operations.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sqlalchemy import delete, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from jobs.records.db import Database
from jobs.records.models import JobProgress, RequestRow, Result, WorkerDeath, WorkerRow, WorkerSample, now
from worker.consumer.ledger import Death, Heartbeat

GONE_AFTER = 30.0  # seconds without a heartbeat
HISTORY = 3600.0  # seconds of samples kept
DEATHS_KEPT = 86400.0  # seconds a worker's death is kept


@dataclass(frozen=True)
class WorkerView:
    beat: Heartbeat  # the worker's last
    gone: bool

    def to_dict(self) -> dict:
        b = asdict(self.beat)
        used, free = b["kv_blocks_used"], b["kv_blocks_free"]
        return {**b, "id": b.pop("worker"), "seen_at": b.pop("at"), "gone": self.gone,
                "kv_share": used / max(1, used + free)}


def beat(db: Database, hb: Heartbeat) -> None:
    values = {"id": hb.worker, "host": hb.host, "model": hb.model, "device": hb.device, "running": hb.running,
              "waiting": hb.waiting, "kv_blocks_used": hb.kv_blocks_used, "kv_blocks_free": hb.kv_blocks_free,
              "output_tokens_per_second": hb.output_tokens_per_second, "started_at": hb.started_at,
              "seen_at": hb.at}
    with db.session() as s, s.begin():
        dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
        upsert = dialect.insert(WorkerRow).values(values)
        s.execute(upsert.on_conflict_do_update(index_elements=["id"],
                                               set_={k: v for k, v in values.items() if k != "id"}))
        s.execute(insert(WorkerSample).values(worker_id=hb.worker, at=hb.at,
                                              output_tokens_per_second=hb.output_tokens_per_second,
                                              kv_blocks_used=hb.kv_blocks_used, kv_blocks_free=hb.kv_blocks_free))
        s.execute(delete(WorkerSample).where(WorkerSample.worker_id == hb.worker, WorkerSample.at < hb.at - HISTORY))
        s.execute(delete(JobProgress).where(JobProgress.worker_id == hb.worker))  # what it runs now, alone
        if hb.job_tokens:
            s.execute(insert(JobProgress), [{"worker_id": hb.worker, "job_id": job_id, "tokens": tokens, "at": hb.at}
                                            for job_id, tokens in hb.job_tokens.items()])


def list_workers(db: Database, include_gone_for: float = HISTORY) -> list[WorkerView]:
    """Workers seen within ``include_gone_for`` seconds, the newest first."""
    t = now()
    with db.session() as s:
        rows = s.scalars(select(WorkerRow).where(WorkerRow.seen_at >= t - include_gone_for)
                         .order_by(WorkerRow.seen_at.desc())).all()
    return [WorkerView(Heartbeat(r.id, r.host, r.model, r.device, r.running, r.waiting, r.kv_blocks_used,
                                 r.kv_blocks_free, r.output_tokens_per_second, r.started_at, r.seen_at),
                       t - r.seen_at > GONE_AFTER) for r in rows]


def samples(db: Database, since: float) -> dict[str, list[tuple[float, float, float]]]:
    """Worker id -> [(at, output tokens/s, KV share used)] since ``since``, oldest first."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    with db.session() as s:
        for wid, at, tps, used, free in s.execute(
                select(WorkerSample.worker_id, WorkerSample.at, WorkerSample.output_tokens_per_second,
                       WorkerSample.kv_blocks_used, WorkerSample.kv_blocks_free)
                .where(WorkerSample.at >= since).order_by(WorkerSample.at)):
            out.setdefault(wid, []).append((at, tps, used / max(1, used + free)))
    return out


def found_dead(s: Session, lives: dict[str, str]) -> dict[str, Death]:
    """Life -> its death, for the dead worker processes ``lives`` (life -> "host:pid"), in the claim's
    transaction before it takes their rows: recorded by the first claim to find each (the count of
    its requests an engine step had run and that have no outcome), read by the later ones."""
    if not lives:
        return {}
    dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
    t = now()
    known = set(s.scalars(select(WorkerDeath.life).where(WorkerDeath.life.in_(lives))))
    for life in sorted(set(lives) - known):  # one order: two claims finding the same deaths wait, not deadlock
        worker = lives[life]
        held = (RequestRow.holder_life == life if life != worker[:32]  # else rows claimed before lives were kept
                else RequestRow.holder_life.is_(None) & (RequestRow.holder == worker))
        running = s.scalar(select(func.count(RequestRow.id)).outerjoin(Result, Result.request_id == RequestRow.id)
                           .where(held, RequestRow.started, Result.id.is_(None)))
        s.execute(dialect.insert(WorkerDeath).values(life=life, worker=worker, host=host_of(worker), at=t,
                                                     running=max(1, running or 0))
                  .on_conflict_do_nothing(index_elements=["life"]))
    if len(known) < len(lives):
        s.execute(delete(WorkerDeath).where(WorkerDeath.at < t - DEATHS_KEPT))
    rows = s.scalars(select(WorkerDeath).where(WorkerDeath.life.in_(lives))).all()
    return {r.life: Death(r.id, r.worker, r.running, r.at) for r in rows}


def deaths_by_host(db: Database, window: float) -> dict[str, int]:
    """host -> its worker processes found dead in the last ``window`` seconds."""
    with db.session() as s:
        return dict(s.execute(select(WorkerDeath.host, func.count()).where(WorkerDeath.at >= now() - window)
                              .group_by(WorkerDeath.host)).all())


def host_of(worker: str) -> str:
    """The host of a worker named "host:pid"."""
    return worker.rpartition(":")[0] or worker
